"""`harness profiles`: list, show and export the network profiles."""

from __future__ import annotations

from pathlib import Path

import click
import yaml
from rich.table import Table
from rich.text import Text

from harness.cli.common import console
from harness.net.profiles import load_profile


@click.group("profiles")
def profiles() -> None:
    """Network profiles (netem_profiles/*.yaml)."""


@profiles.command("list")
def profiles_list() -> None:
    """The named profiles: the inter-cluster link's rate, round-trip time and loss side by side."""
    from harness.net.profiles import profiles_table_rows

    table = Table("name", "rate", "RTT", "jitter", "loss", "description")
    for column in table.columns[:-1]:
        column.no_wrap = True
    for row in profiles_table_rows():
        table.add_row(*(Text(str(row[key])) for key in ("name", "rate", "rtt", "jitter", "loss", "description")))
    console.print(table)


@profiles.command("export")
@click.argument("name")
@click.option("--format", "fmt", type=click.Choice(["tcconfig"]), default="tcconfig", show_default=True)
@click.option("--device", default="eth0", show_default=True, help="The interface the settings are for.")
@click.option("--out", default="-", show_default=True, help="File to write, or - for standard output.")
@click.option("--allow-reorder", is_flag=True, help="Export jitter although netem (which tcset drives) reorders.")
def profiles_export(name: str, fmt: str, device: str, out: str, allow_reorder: bool) -> None:
    """Write a profile's inter-cluster link for real hosts: `tcset --import-setting FILE` on each site's NIC."""
    from harness.net.tcconfig import write_tcconfig

    write_tcconfig(load_profile(name), out, device=device, allow_reorder=allow_reorder)


@profiles.command("show")
@click.argument("name")
def profiles_show(name: str) -> None:
    """A profile's YAML and how it is read."""
    p = load_profile(name)
    click.echo(f"# {p.source}")
    click.echo(Path(p.source).read_text().rstrip())
    click.echo(f"# inter-cluster: {p.inter_cluster.describe()}")
    click.echo(f"# intra-cluster: {p.intra_cluster.describe()}")
    for line in p.topology_lines():
        click.echo(f"# topology: {line}")
    click.echo(yaml.safe_dump({"parsed": p.to_dict()}, sort_keys=False).rstrip())
