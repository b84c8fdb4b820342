# The replica image the Helm chart runs (`image.repository`). Build: docker build -t stargate .
# The chart runs it as uid/gid 10001 with a read-only root filesystem (/tmp is an emptyDir).
FROM python:3.11-slim
WORKDIR /opt/stargate
COPY pyproject.toml README.md ./
COPY stargate ./stargate
RUN pip install --no-cache-dir . && groupadd --gid 10001 stargate \
    && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin stargate
USER 10001:10001
ENTRYPOINT []
CMD ["stargate", "serve"]
