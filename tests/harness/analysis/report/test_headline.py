"""The headline tables README prints (harness/analysis/report/headline.py): one row per method and link, measured
where the method ran end to end there, and the composition's check in one line."""

from __future__ import annotations

from harness.analysis.report.compare_files import write_outputs
from harness.analysis.report.headline import HEADER, headline_markdown
from harness.analysis.report.time_to_target import analyse
from tests.harness.analysis.comparing import fake_compare, spec_of


def table_rows(text: str, profile: str) -> list[list[str]]:
    """The cells of `profile`'s table in the headline."""
    block = text.split(f"**{profile}**")[1].split("\n\n")[1]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in block.splitlines()[2:]]


def test_a_link_measured_and_composed_shows_the_measured_rows_and_the_check_in_one_line(tmp_path):
    """100mbps measured and composed (the check), 10mbps composed only: the first table holds the measured runs
    (allreduce 40 steps at 1000 tokens/s per seed 0, 1, 2 ...), the second the composed ones."""
    spec = spec_of(profiles=("100mbps",), composed=("100mbps", "10mbps"))
    fake_compare(tmp_path, spec, slower={"10mbps": 10.0})
    result = analyse(spec, tmp_path)
    text = headline_markdown(result)
    measured, composed = table_rows(text, "100mbps"), table_rows(text, "10mbps")
    assert [r[1] for r in measured] == ["measured", "measured"] and [r[1] for r in composed] == ["composed"] * 2
    assert [r[0] for r in measured] == ["allreduce", "opendiloco (local_steps=10)"]
    assert len(measured[0]) == len(HEADER)
    # The same figures compare.md prints for those rows.
    by_method = result.rows.set_index(["profile", "how", "method"])
    opendiloco = by_method.loc[("100mbps", "measured", "opendiloco")]
    assert measured[1][3].startswith(f"{opendiloco['speedup']:.3g}x")
    assert measured[1][5] == f"{opendiloco['wire_bytes_per_token']:,.1f}"
    ten = by_method.loc[("10mbps", "composed", "allreduce")]
    assert composed[0][2].startswith(f"{ten['time_to_target_s']:,.1f} s")
    assert "composed / measured time to target, paired per seed): allreduce 1.000x" in text
    assert text.count("The composition checked here") == 1
    assert text.startswith("Target validation loss: ")


def test_compare_writes_the_headline_beside_compare_md(tmp_path):
    spec = spec_of()
    fake_compare(tmp_path, spec)
    result = analyse(spec, tmp_path)
    write_outputs(result, tmp_path, None)
    assert (tmp_path / "headline.md").read_text() == headline_markdown(result)
    assert "The composition checked here" not in headline_markdown(result)


def test_a_target_the_control_reaches_is_flagged_in_the_headline(tmp_path):
    spec = spec_of(methods=("allreduce", "opendiloco", "local"), seeds=(0, 1), target_loss=4.75)
    fake_compare(tmp_path, spec)
    assert "local reaches the target (2 of 2 seeds, measured) without ever communicating" in headline_markdown(
        analyse(spec, tmp_path)
    )


def test_allreduce_comes_first_and_the_control_last(tmp_path):
    spec = spec_of(methods=("local", "opendiloco", "allreduce"))
    fake_compare(tmp_path, spec)
    rows = table_rows(headline_markdown(analyse(spec, tmp_path)), "1gbps")
    assert [r[0] for r in rows] == ["allreduce", "opendiloco (local_steps=10)", "local"]
