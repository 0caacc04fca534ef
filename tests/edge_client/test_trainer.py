import torch

from edge_client.trainer import train_local
from tasks import evaluate, make_task


def _drift(model: torch.nn.Module, start: list[torch.Tensor]) -> float:
    return sum(float((p.detach() - s).pow(2).sum()) for p, s in zip(model.parameters(), start))


def test_local_training_learns_and_fedprox_limits_drift() -> None:
    task = make_task("digits")
    data = task.partition(0, 4, "iid")
    drifts = {}
    for mu in (0.0, 1.0):
        torch.manual_seed(0)
        model = task.build_model()
        start = [p.detach().clone() for p in model.parameters()]
        result = train_local(model, data, epochs=10, lr=0.05, batch_size=32, momentum=0.9, prox_mu=mu,
                             generator=torch.Generator().manual_seed(1))
        drifts[mu] = _drift(model, start)
        assert result.examples == len(data) and result.steps == 10 * -(-len(data) // 32)
        if mu == 0.0:
            _, accuracy = evaluate(model, task.test_data())
            assert accuracy > 0.5
    assert drifts[1.0] < drifts[0.0]
