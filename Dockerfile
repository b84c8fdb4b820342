# The replica image the Helm chart runs (`image.repository`). Build: docker build -t stargate .
# The chart runs it as uid/gid 10001 with a read-only root filesystem (/tmp is an emptyDir).
# Python 3.13: the interpreter `nox -s bench` and `nox -s bench-3.13` chose (docs/performance.md,
# "Python 3.11 and 3.13"); CI runs the test suite on it too (`nox -s tests-3.13`).
FROM python:3.13-slim
WORKDIR /opt/stargate
COPY pyproject.toml README.md ./
COPY stargate ./stargate
RUN pip install --no-cache-dir . && groupadd --gid 10001 stargate \
    && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin stargate
USER 10001:10001
ENTRYPOINT []
CMD ["stargate", "serve"]
