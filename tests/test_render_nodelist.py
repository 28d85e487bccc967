"""SLURM hostlist expansion (hpctrain.nodelist.expand), compared with `scontrol show hostnames`
semantics: zero padding from the low bound, several ranges, top-level comma lists."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from hpctrain.errors import HpcUsageError
from hpctrain.nodelist import expand, rendezvous_port, rendezvous_port_shell

CASES = {
    "node1": ["node1"],
    "node[1-4,7],gpu01": ["node1", "node2", "node3", "node4", "node7", "gpu01"],
    "n[08-11]": ["n08", "n09", "n10", "n11"],
    "n[1-2,010-011]": ["n1", "n2", "n010", "n011"],
    "r[1-2]n[1-2]": ["r1n1", "r1n2", "r2n1", "r2n2"],
    "a-[1-2].b,c": ["a-1.b", "a-2.b", "c"],
    "gpu[7]": ["gpu7"],
}


@pytest.mark.parametrize("text, hosts", CASES.items())
def test_expand(text: str, hosts: list[str]) -> None:
    assert expand(text) == hosts


@pytest.mark.parametrize("text, match", [
    ("", "no hosts"), ("a,,b", "empty element"), ("n[1-", "unbalanced"), ("n1-]", "unbalanced"),
    ("n[3-1]", "backwards"), ("n[a-b]", "bad range"), ("n[[1]]", "nested"), ("a b", "whitespace"),
])
def test_bad_nodelists(text: str, match: str) -> None:
    with pytest.raises(HpcUsageError, match=match):
        expand(text)


@pytest.mark.skipif(not shutil.which("scontrol"), reason="no scontrol")
# SLURM 22.05 rejects text after a bracket ("a-[1-2].b"); newer versions and we accept it.
@pytest.mark.parametrize("text", [t for t in CASES if "]." not in t])
def test_matches_scontrol(text: str) -> None:
    out = subprocess.run(["scontrol", "show", "hostnames", text], capture_output=True, text=True, timeout=30,
                         check=False)
    if out.returncode != 0:
        pytest.skip(f"scontrol could not run: {out.stderr.strip()}")
    assert expand(text) == out.stdout.split()


@pytest.mark.parametrize("job_id", ["1", "4242", "11999", "987654321", "4294967295"])
def test_one_port_formula_for_the_script_and_the_ranks(job_id: str) -> None:
    """The batch script's MASTER_PORT (bash arithmetic rendered from the formula) is what a rank derives."""
    out = subprocess.run(["bash", "-c", f"echo {rendezvous_port_shell()}"], env={"SLURM_JOB_ID": job_id},
                         capture_output=True, text=True, check=True, timeout=10).stdout
    assert int(out) == rendezvous_port(job_id)
    assert 20000 <= rendezvous_port(job_id) <= 31998
