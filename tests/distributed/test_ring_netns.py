"""Ring attention across network namespaces, standing in for separate hosts: each rank in its own
namespace, joined to the others by a veth pair and a bridge, talking gloo over its own address.
Needs root and iproute2; without them the tests skip and say why, except under CI (CI=true),
where that is a failure."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import pytest

from helpers import ring_ranks

HERE = pathlib.Path(__file__).parents[1] / "helpers"  # where ring_netns_rank.py lives
PREFIX = f"akr{os.getpid() % 100000}"  # every namespace and link of this run starts with it


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _unavailable() -> str | None:
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    if os.geteuid() != 0:
        return "not root: network namespaces need CAP_SYS_ADMIN"
    return None


@contextlib.contextmanager
def namespaces(world: int):
    """``world`` namespaces on one bridge; yields ``(namespace, address, device, host link)``
    per rank, and removes every namespace and link it made, whatever happens."""
    why = _unavailable()
    if why is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"network namespaces are required under CI: {why}")
        pytest.skip(why)
    bridge, made = f"{PREFIX}br", []
    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("link", "set", bridge, "up")
        for r in range(world):
            ns, host, inside = f"{PREFIX}n{r}", f"{PREFIX}h{r}", f"{PREFIX}c{r}"
            address = f"10.231.{os.getpid() % 250}.{r + 1}"
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("link", "add", host, "type", "veth", "peer", "name", inside)
            _ip("link", "set", inside, "netns", ns)
            _ip("link", "set", host, "master", bridge)
            _ip("link", "set", host, "up")
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", inside)
            _ip("-n", ns, "link", "set", inside, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            made[-1] = (ns, address, inside, host)
        yield made
    except subprocess.CalledProcessError as error:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip(f"could not make network namespaces: {error.stderr.strip()}")
    finally:
        for r, entry in enumerate(made):
            ns = entry if isinstance(entry, str) else entry[0]
            subprocess.run(["ip", "link", "delete", f"{PREFIX}h{r}"], capture_output=True)
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            for pid in pids.stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), 9)
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True)
        subprocess.run(["ip", "link", "delete", bridge], capture_output=True)


def start_ranks(spaces, job: str, *extra: str) -> list[subprocess.Popen]:
    port = ring_ranks.free_port()
    pythonpath = os.pathsep.join([str(HERE), *sys.path])
    ranks = []
    for r, (ns, _, device, _) in enumerate(spaces):
        command = [sys.executable, str(HERE / "ring_netns_rank.py"), "--job", job, *extra]
        command += ["--rank", str(r), "--world", str(len(spaces)), "--port", str(port)]
        command += ["--master", spaces[0][1]]
        env = {**os.environ, "PYTHONPATH": pythonpath, "GLOO_SOCKET_IFNAME": device}
        ranks.append(
            subprocess.Popen(
                ["ip", "netns", "exec", ns, *command],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return ranks


def results(ranks: list[subprocess.Popen], wait: float = 120.0) -> list[dict]:
    found = []
    for r, p in enumerate(ranks):
        out, err = p.communicate(timeout=wait)
        assert p.returncode == 0, f"rank {r} failed:\n{err[-3000:]}"
        found.append(json.loads(out.strip().splitlines()[-1]))
    return found


def leftovers() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return [line for line in (listed + links).splitlines() if PREFIX in line]


@pytest.mark.slow
def test_ring_attention_across_namespaces_equals_attention_of_the_whole_sequence():
    with namespaces(3) as spaces:
        found = results(start_ranks(spaces, "compare"))
    assert leftovers() == []
    for rank, by_case in enumerate(found):
        for name, difference in by_case["causal, zigzag, GQA, ALiBi"].items():
            if not name.endswith(" scale"):
                assert difference <= 1e-10, f"rank {rank}: {name} differs by {difference:.3g}"


@pytest.mark.slow
def test_a_link_taken_down_mid_backward_makes_every_rank_raise_within_the_timeout(tmp_path):
    timeout, victim = 5.0, 1
    with namespaces(3) as spaces:
        ranks = start_ranks(
            spaces, "link-down", "--timeout", str(timeout), "--markers", str(tmp_path)
        )
        deadline = time.monotonic() + 120
        while not (tmp_path / f"backward-{victim}").exists():
            assert time.monotonic() < deadline, "the backward never began"
            assert all(p.poll() is None for p in ranks), "a rank ended before its backward"
            time.sleep(0.05)
        _ip("link", "set", spaces[victim][3], "down")  # the victim's cable, pulled
        found = results(ranks)
    assert leftovers() == []
    for rank, result in enumerate(found):
        assert result["error"] is not None, f"rank {rank} finished its backward"
        assert result["seconds"] <= timeout + 10 + 2  # + the backward's announced pause
        assert f"ring attention: rank {rank} of 3" in result["error"]
