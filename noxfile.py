"""Developer and CI sessions. `nox -s tests lint typecheck` is what CI runs (see .ci/run)."""

from __future__ import annotations

import nox

nox.options.sessions = ["tests", "lint", "typecheck"]
nox.options.reuse_existing_virtualenvs = True

PYTHON = None  # the interpreter nox itself runs on (CI: the machine's default, 3.11)


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The whole test suite: unit, mock-clock, in-process and real-process tests."""
    session.install("-e", ".[test]")
    session.run("pytest", *session.posargs)


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


BENCH_EXTRAS = {"proxy": ".[test]", "capacity": ".[test,bench]"}


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Benchmarks on loopback: `nox -s bench -- proxy [--quick]` (see benchmarks/proxy.py) and
    `nox -s bench -- capacity [--quick]` (see benchmarks/capacity.py; writes bench-results/)."""
    if not session.posargs or session.posargs[0] not in BENCH_EXTRAS:
        session.error(
            "usage: nox -s bench -- proxy [--quick] [options; see --help]\n"
            "       nox -s bench -- capacity [--quick] [options; see --help]"
        )
    part = session.posargs[0]
    session.install("-e", BENCH_EXTRAS[part])
    session.run("python", "-m", f"benchmarks.{part}", *session.posargs[1:])


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
        "helm-python-sdk==0.2.2", "kubernetes-validate==1.37.0", "yamllint", "pyyaml", "pytest"
    )
    session.install("-e", ".")
    session.run("pytest", "tests/helm/test_chart.py", "-q", *session.posargs)
