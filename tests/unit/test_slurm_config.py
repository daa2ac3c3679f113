"""The dev Slurm cluster's configs as rendered for N nodes (no Slurm needed)."""

from pathlib import Path

from trainflow.cluster.dev.slurm_config import (
    HOSTS_MARK,
    DevCluster,
    main,
    slurm_conf,
    with_hosts_line,
)


def _cluster(nodes: int) -> DevCluster:
    return DevCluster(Path("/b"), 6817, nodes, real_memory_mb=20000, host="vm")


def test_each_node_gets_its_own_port_and_a_share_of_cpus_and_memory() -> None:
    lines = [ln for ln in slurm_conf(_cluster(2)).splitlines() if ln.startswith("NodeName=")]
    assert [ln.split()[0] for ln in lines] == ["NodeName=tfnode1", "NodeName=tfnode2"]
    assert "Port=6821 CPUs=4" in lines[0] and "Port=6822 CPUs=4" in lines[1]
    assert all("RealMemory=9000 Gres=gpu:2" in ln for ln in lines)


def test_per_node_paths_use_percent_n() -> None:
    conf = slurm_conf(_cluster(3))
    for key in ("SlurmdSpoolDir=/b/spool/slurmd-%n", "SlurmdPidFile=/b/run/slurmd-%n.pid"):
        assert key in conf


def test_the_hosts_line_is_merged_not_repeated() -> None:
    hosts = with_hosts_line("127.0.0.1 localhost\n", f"127.0.0.1 tfnode1 {HOSTS_MARK}")
    hosts = with_hosts_line(hosts, f"127.0.0.1 tfnode1 tfnode2 {HOSTS_MARK}")
    assert hosts == f"127.0.0.1 localhost\n127.0.0.1 tfnode1 tfnode2 {HOSTS_MARK}\n"
    # A second, smaller cluster beside it keeps the first one's names resolving.
    hosts = with_hosts_line(hosts, f"127.0.0.1 tfnode1 {HOSTS_MARK}")
    hosts = with_hosts_line(hosts, f"127.0.0.1 tfnode10 {HOSTS_MARK}")
    assert hosts == f"127.0.0.1 localhost\n127.0.0.1 tfnode1 tfnode2 tfnode10 {HOSTS_MARK}\n"


def test_write_reports_a_change_only_once(tmp_path: Path, capsys: object) -> None:
    args = ["write", "--base", str(tmp_path), "--port", "7000", "--nodes", "2"]
    args += ["--hw", "NodeName=x RealMemory=4000", "--hosts", str(tmp_path / "hosts")]
    assert main(args) == 0
    assert main(args) == 0
    out = capsys.readouterr().out.splitlines()  # type: ignore[attr-defined]
    nodes = ["tfnode1 7004", "tfnode2 7005"]
    assert out == ["changed", *nodes, "unchanged", *nodes]
    assert (tmp_path / "etc" / "slurmdbd.conf").stat().st_mode & 0o777 == 0o600
    assert "tfnode1 tfnode2" in (tmp_path / "hosts").read_text()
