"""compressed(FedAvg(), ...) before and after the downlink became one layer: 6 rounds, 3 in-process
nodes (the tests' user app with compression_mod), node 12 silent in round 3, a corrupt payload from
node 13 in round 4; per round the model's digest and the bytes each way. Run it against two trees
and diff the outputs (2026-11-29, 2-core Xeon; 83faa18.out and new.out here are identical). From
the repository root:

    ROOT=$PWD OLD=$(mktemp -d)
    git worktree add "$OLD/tree" 83faa18 && ln -s "$OLD/tree" "$OLD/fedge"
    (cd "$OLD" && PYTHONPATH="$OLD:$OLD/tree" "$ROOT/.venv/bin/python" "$ROOT/bench/results/one-downlink/same_bytes.py") > old.out
    PYTHONPATH=. .venv/bin/python bench/results/one-downlink/same_bytes.py > new.out; diff old.out new.out
"""
import hashlib
import numpy as np
import fedge.edge_client.compression_mod as client_mod
from flwr.app import ConfigRecord
from flwr.serverapp.strategy import FedAvg
from fedge.flower import compressed
from fedge.protocol.records import UPDATE_RECORD, read_payload, payload_record
from tests.flower.test_compressed_strategy import NODES, Grid, _contexts, _exchange, _model, _user_app
from flwr.supercore.task_identity import TaskIdentity
TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0
import torch, random; torch.manual_seed(0)
client_mod.os.urandom = lambda n: (12345).to_bytes(8, "little")[:n]
for spec, down in [("qsgd:bits=4", "lattice:ratio=0.05"), ("tcs:extra=0.01,sample=0+qsgd:bits=4", "lattice:ratio=0.05"), ("dgc:ratio=0.05", "none")]:
    torch.manual_seed(0); random.seed(0)
    wrapped = compressed(FedAvg(), uplink=spec, downlink=down, seed=7)
    arrays, apps, contexts = _model(), {n: _user_app() for n in NODES}, _contexts()
    for r in range(1, 7):
        messages = list(wrapped.configure_train(r, arrays, ConfigRecord({"lr": 0.1}), Grid()))
        if r == 3:
            messages = [m for m in messages if m.metadata.dst_node_id != 12]
        replies = _exchange(messages, apps, contexts)
        if r == 4:
            for reply in replies:
                if reply.metadata.src_node_id == 13:
                    p = bytearray(read_payload(reply.content, UPDATE_RECORD)); p[-5] ^= 0xFF
                    reply.content[UPDATE_RECORD] = payload_record(bytes(p))
        arrays, metrics = wrapped.aggregate_train(r, replies)
        print(spec, down, r, hashlib.sha256(np.concatenate([a.numpy().ravel() for a in arrays.values()]).tobytes()).hexdigest()[:8], {k: metrics[k] for k in ("fedge-uplink-bytes", "fedge-downlink-bytes", "fedge-refused")})
    flat = np.concatenate([a.numpy().ravel() for a in arrays.values()])
    print(spec, down, "final", hashlib.sha256(flat.tobytes()).hexdigest()[:16])
