"""Developer and CI sessions. `nox -s tests lint typecheck` is what CI runs (see .ci/run)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import nox

nox.options.sessions = ["tests", "lint", "typecheck"]
nox.options.reuse_existing_virtualenvs = True

PYTHON = None  # the interpreter nox itself runs on (CI: the machine's default, 3.11)


def _pyenv_python(version: str) -> str:
    """`version` as nox should look for it, or the newest pyenv interpreter of that version when
    none is on PATH (pyenv's shims only answer for the versions `pyenv` has selected)."""
    on_path = shutil.which(f"python{version}")
    if on_path and "shims" not in Path(on_path).parts:
        return version
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    found = sorted(
        (root / "versions").glob(f"{version}.*/bin/python{version}"),
        key=lambda path: [int(part) for part in path.parts[-3].split(".") if part.isdigit()],
    )
    return str(found[-1]) if found else version


def _pytest_args(session: nox.Session) -> list[str]:
    """Arguments after `--` replace the defaults (`nox -s tests -- tests/unit -x`). By default the
    suite runs on one worker per core (pytest-xdist; at most 4: the end-to-end tests start
    several processes each, and timing bounds assume they are not starved), the long modules
    first (tests/conftest.py), and the slowest tests are listed at the end, so a run says where
    the suite's time goes."""
    return list(session.posargs) or [
        "--numprocesses=auto",
        "--maxprocesses=4",
        "--dist=worksteal",
        "--durations=30",
    ]


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The whole test suite: unit, mock-clock, in-process and real-process tests."""
    session.install("-e", ".[test]")
    session.run("pytest", *_pytest_args(session))


@nox.session(name="tests-3.13", python=_pyenv_python("3.13"))
def tests_313(session: nox.Session) -> None:
    """The whole test suite on Python 3.13, the image's interpreter (Dockerfile)."""
    session.install("-e", ".[test]")
    session.run("pytest", *_pytest_args(session))


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff lint and format check over the package, tests and this file."""
    session.install(".[lint]")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    """mypy --strict over the package."""
    session.install("-e", ".[typecheck]")
    session.run("mypy", "--strict", "stargate")


@nox.session(python=PYTHON)
def protos(session: nox.Session) -> None:
    """Regenerate stargate/protocol/*_pb2*.py from the .proto files (commit the result)."""
    session.install("-e", ".[test]")
    session.run("python", "-m", "stargate.protocol.generate")


BENCH_PARTS = {
    "tunnels",
    "proxy",
    "stream",
    "registration",
    "readiness",
    "activator",
    "affinity",
    "routing",
    "capacity",
    "peers",
}


SGLANG_ROUTER = "sglang-router==0.3.2"
"""The affinity part's comparison router (benchmarks/affinity.py), and one of the peers part's
(benchmarks/peers.py). Only the bench sessions install it, never the project's extras; without it
those parts skip the sglang-router rows."""
VLLM_ROUTER = "vllm-router==0.1.17"
"""The peers part's other Rust router (benchmarks/peers.py), installed the same way."""


def _bench(session: nox.Session) -> None:
    session.install("-e", ".[test,bench]")
    parts = set(session.posargs) & BENCH_PARTS
    if not parts or parts & {"affinity", "peers"}:
        try:
            session.install(SGLANG_ROUTER)
        except nox.command.CommandFailed:
            session.log(f"{SGLANG_ROUTER} did not install: affinity and peers skip its rows")
    if not parts or "peers" in parts:
        try:
            session.install(VLLM_ROUTER)
        except nox.command.CommandFailed:
            session.log(f"{VLLM_ROUTER} did not install: the peers part skips its column")
    wants_nginx = not parts or parts & {"proxy", "peers"}
    if wants_nginx and not (shutil.which("nginx") or Path("/usr/sbin/nginx").exists()):
        if hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get"):
            session.log("nginx is missing: trying apt-get install -y nginx-light")
            session.run(
                "apt-get", "install", "-y", "nginx-light", external=True, success_codes=[0, 100]
            )
        else:
            session.log("nginx is missing (and this is not root): the proxy part skips it")
    session.run("python", "-m", "benchmarks", *session.posargs)


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """The loopback benchmark suite (benchmarks/__main__.py): `nox -s bench` runs proxy, stream,
    registration, readiness, activator, affinity, prefix-decision, client-limits and peers;
    `nox -s bench -- NAME [NAME...] [--quick] [--profile] [options; see --help]` chosen parts
    (`capacity`, `routing` and `tunnels` only when named). The affinity and peers parts also get
    sglang-router 0.3.2 installed, and peers vllm-router 0.1.17 (each when it installs), to
    compare with.
    Results in bench-results/ (<part>.md, <part>.json, charts, summary.md)."""
    _bench(session)


@nox.session(name="bench-3.13", python=_pyenv_python("3.13"))
def bench_313(session: nox.Session) -> None:
    """The same suite with everything (the replica under test included) on Python 3.13."""
    _bench(session)


@nox.session(python=PYTHON)
def rollout(session: nox.Session) -> None:
    """Rolling-restart rehearsal on loopback: `nox -s rollout -- [--warmup both] [--runs K]`
    (see benchmarks/rollout.py); tables on stdout, PNG timelines in benchmarks/out/."""
    session.install("-e", ".[test,bench]")
    session.run("python", "-m", "benchmarks.rollout", *session.posargs)


@nox.session(python=PYTHON)
def helm(session: nox.Session) -> None:
    """The Helm chart, offline: render, values schema, kubernetes-validate --strict, yamllint."""
    session.install(
        "helm-python-sdk==0.2.2",
        "kubernetes-validate==1.37.0",
        "yamllint",
        "pyyaml",
        "pytest",
        "trustme",  # the live replica of tests/helm/test_observability.py serves TLS
    )
    session.install("-e", ".")
    # tests/helm/test_observability.py also runs promtool and a real replica.
    session.run("pytest", "tests/helm", "-q", *session.posargs)
