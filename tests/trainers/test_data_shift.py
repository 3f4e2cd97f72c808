"""--data-shift: every N steps each replica's batches move to another contiguous segment of its shard."""

import dataclasses

import pytest
import torch
from click.testing import CliRunner

import harness.cli as cli
import harness.run.runner
from harness.analysis.plan import build_config, check_keys
from harness.run.config import RunConfig
from harness.run.settings import parse_assignment
from trainers.config import TrainConfig
from trainers.data import (
    SHIFT_SEGMENTS,
    Corpus,
    _segment_bounds,
    check_data,
    data_phase,
    load_corpus,
    replica_batches,
    replica_shard,
    shift_order,
    validation_batches,
)

SEGMENT = 2_000
# One replica's shard holds SHIFT_SEGMENTS segments of SEGMENT bytes; segment j holds only byte values in
# [16 j, 16 j + 16), so any window says which segment it came from.
BAND = 256 // SHIFT_SEGMENTS


def banded_corpus(n_replicas: int = 1) -> Corpus:
    gen = torch.Generator().manual_seed(0)
    shard = torch.cat([torch.randint(j * BAND, (j + 1) * BAND, (SEGMENT,), generator=gen) for j in range(8)])
    train = shard.repeat(n_replicas).to(torch.uint8)
    return Corpus(train, torch.zeros(100, dtype=torch.uint8), "synthetic", "")


def segment_of(x: torch.Tensor, y: torch.Tensor) -> int:
    """The one segment every byte of a batch comes from (fails if the batch mixes segments)."""
    bands = set((torch.cat([x, y], dim=1) // BAND).unique().tolist())
    assert len(bands) == 1, f"a batch mixes segments {bands}"
    return bands.pop()


def take(it, n):
    return [next(it) for _ in range(n)]


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return load_corpus(max_bytes=1 << 20)


def test_batches_follow_the_seeded_segment_order_every_n_steps():
    assert SHIFT_SEGMENTS == 8 and 256 % SHIFT_SEGMENTS == 0
    shift = 3
    batches = take(replica_batches(banded_corpus(), 0, 1, 4, 32, seed=5, data_shift=shift), 2 * 8 * shift + 1)
    order = shift_order(5)
    assert sorted(order) == list(range(8))
    for i, (x, y) in enumerate(batches):
        assert segment_of(x, y) == order[data_phase(i, shift) % 8], f"batch {i}"


def test_consecutive_phases_draw_from_disjoint_byte_ranges():
    batches = take(replica_batches(banded_corpus(), 0, 1, 8, 64, seed=0, data_shift=2), 2 * 8)
    segments = [segment_of(x, y) for x, y in batches]
    assert segments[0::2] == segments[1::2]  # two steps per phase
    phases = segments[0::2]
    assert all(a != b for a, b in zip(phases, phases[1:], strict=False))
    assert sorted(phases) == list(range(8))  # every segment once per cycle of 8 phases


def test_segments_are_disjoint_and_cover_the_shard():
    for n in (8, 9, 15, 1001, 123_457):
        bounds = _segment_bounds(n)
        assert bounds[0][0] == 0 and bounds[-1][1] == n
        assert all(stop == start for (_, stop), (start, _) in zip(bounds, bounds[1:], strict=False))
        assert all(stop - start >= n // 8 for start, stop in bounds)


def test_real_windows_come_from_the_phase_segment_only(corpus):
    shard = replica_shard(corpus, 1, 2)
    segments = [bytes(shard[a:b].tolist()) for a, b in _segment_bounds(len(shard))]
    order = shift_order(0)
    stream = replica_batches(corpus, 1, 2, 4, 64, seed=0, data_shift=2)
    for step in range(6):
        x, y = next(stream)
        own = segments[order[data_phase(step, 2) % 8]]
        # Real text repeats (licence headers), so only the synthetic tests above can show disjointness.
        for row in torch.cat([x, y[:, -1:]], dim=1):
            assert bytes(row.tolist()) in own


def test_same_seed_same_batches_and_every_replica_shifts_at_the_same_steps():
    corpus = banded_corpus(n_replicas=2)

    def stream(replica, seed):
        return take(replica_batches(corpus, replica, 2, 4, 32, seed, data_shift=4), 20)

    a, b = stream(0, 7), stream(0, 7)
    assert all(torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(a, b, strict=True))
    assert not torch.equal(a[0][0], stream(0, 8)[0][0])
    other = stream(1, 7)
    assert not torch.equal(a[0][0], other[0][0])
    assert [segment_of(*batch) for batch in a] == [segment_of(*batch) for batch in other]
    assert shift_order(7) == shift_order(7)
    assert len({tuple(shift_order(s)) for s in range(10)}) > 1


def test_off_leaves_the_stream_unchanged(corpus):
    a = take(replica_batches(corpus, 0, 2, 4, 64, seed=3), 5)
    b = take(replica_batches(corpus, 0, 2, 4, 64, seed=3, data_shift=0), 5)
    assert all(torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(a, b, strict=True))


def test_config_refuses_a_negative_or_non_integer_shift():
    TrainConfig(data_shift=50).validate()
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match=r"^--data-shift must be 0 \(off\) or a positive number of steps"):
            dataclasses.replace(TrainConfig(), data_shift=bad).validate()
    with pytest.raises(ValueError, match="data_shift must be 0"):
        replica_batches(banded_corpus(), 0, 1, 4, 32, seed=0, data_shift=-1)


def test_segments_too_short_for_a_window_are_refused_before_the_first_batch():
    corpus = banded_corpus()  # shard of 8 x 2000 bytes: segments hold windows of at most 2000 bytes
    replica_batches(corpus, 0, 1, 1, SEGMENT - 1, seed=0, data_shift=1)
    with pytest.raises(ValueError, match=r"2000 bytes, fewer than seq_len \+ 1 = 2001; .* no --data-shift\.$"):
        replica_batches(corpus, 0, 1, 1, SEGMENT, seed=0, data_shift=1)
    next(replica_batches(corpus, 0, 1, 1, SEGMENT, seed=0))  # the whole shard still holds it without a shift


def loads(path: str, seq_len: int, replicas: int, shift: int) -> bool:
    """What a worker does with the data: load it, draw a batch on every replica, build the evaluation batches."""
    try:
        corpus = load_corpus(path)
        for r in range(replicas):
            next(replica_batches(corpus, r, replicas, 2, seq_len, seed=0, data_shift=shift))
        validation_batches(corpus, 2, seq_len, 3)
    except ValueError:
        return False
    return True


def checks(path: str, seq_len: int, replicas: int, shift: int) -> bool:
    try:
        check_data(path, seq_len, replicas, data_shift=shift)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_check_data_refuses_exactly_what_the_shifted_stream_would(tmp_path, replicas):
    # The training split is a.txt alone (b.txt, the last of two files, is held out): a window fits each shard
    # throughout, so only the segments decide, and the lengths cross where they first hold one.
    seq_len = 32
    (tmp_path / "b.txt").write_text("v" * 1000)
    verdicts = set()
    for length in range(8 * replicas * seq_len - 40, 8 * replicas * (seq_len + 1) + 40, 3):
        (tmp_path / "a.txt").write_text("w" * length)
        assert checks(str(tmp_path), seq_len, replicas, 0) and loads(str(tmp_path), seq_len, replicas, 0)
        verdict = checks(str(tmp_path), seq_len, replicas, 10)
        assert verdict == loads(str(tmp_path), seq_len, replicas, 10), length
        verdicts.add(verdict)
    assert verdicts == {False, True}


def test_check_data_names_data_shift_and_the_fix(tmp_path):
    # 1,900 training bytes (b.txt, the last of two files, is held out): a window of 129 in each of 2 shards of 950
    # bytes, not in their 8 segments of 118 or 119.
    (tmp_path / "a.txt").write_text("w" * 1_900)
    (tmp_path / "b.txt").write_text("v" * 1_000)
    check_data(str(tmp_path), 128, 2)
    with pytest.raises(ValueError) as err:
        check_data(str(tmp_path), 128, 2, data_shift=50)
    assert str(err.value) == (
        f"--data-shift cuts each of the 2 clusters' training shards into 8 segments, and --data folder {tmp_path}'s "
        "training split (1,900 bytes) leaves some of them only 118 bytes, fewer than seq_len + 1 = 129; add text, "
        "pass a shorter --seq-len or fewer --clusters, or drop --data-shift"
    )
    with pytest.raises(ValueError, match=r"^--data-shift cuts the training split into 8 segments, .* a shorter --seq"):
        check_data(str(tmp_path), 256, 1, data_shift=50)


def test_the_default_corpus_holds_shifted_windows_of_the_largest_runs():
    check_data(None, 1024, 8, data_shift=50)


class Parsed(Exception):
    pass


def test_the_cli_and_sweeps_pass_the_setting_through(monkeypatch):
    seen = {}

    def stop(config, out):
        seen["config"] = config
        raise Parsed

    monkeypatch.setattr(harness.run.runner, "validate", stop)
    result = CliRunner().invoke(cli.main, ["run", "--data-shift", "50"])
    assert isinstance(result.exception, Parsed), result.output
    assert seen["config"].train.data_shift == 50
    help_text = " ".join(CliRunner().invoke(cli.main, ["run", "--help"]).output.split())
    assert "--data-shift N Every N steps" in help_text and "[default: 0 = off]" in help_text
    assert RunConfig.build("allreduce", "1gbps").train.data_shift == 0
    _, key, values = parse_assignment("data-shift=10,20")
    check_keys([key])
    assert build_config("allreduce", "1gbps", 0, {key: values[1]}).train.data_shift == 20
