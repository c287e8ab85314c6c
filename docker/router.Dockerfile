# kvfleet router: docker build -f docker/router.Dockerfile -t ghcr.io/kvfleet/kvfleet-router:0.1.0 .
# The project is one distribution whose dependencies include torch; the router needs none of that, so the package
# goes in with --no-deps and only the router's own dependencies (versions read from pyproject.toml). The operator
# runs it for each InferenceRouter (KVFLEET_ROUTER_IMAGE), with `kvfleet-router --kubernetes ...` as the command.
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY agent agent
COPY kernels kernels
COPY contract contract
COPY router router
COPY operator operator
RUN python -c "import re, tomllib; deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; \
wanted = {'aiohttp', 'prometheus-client', 'pyyaml'}; \
print('\n'.join(d for d in deps if re.split(r'[<>=!~\[ ;]', d, maxsplit=1)[0].lower() in wanted))" > /tmp/router-requirements.txt \
    && cat /tmp/router-requirements.txt \
    && pip install -r /tmp/router-requirements.txt \
    && pip install --no-deps . \
    && python -c "import kvfleet_router.cli" \
    && kvfleet-router --help > /dev/null

FROM python:${PYTHON_VERSION}-slim
RUN useradd --uid 1000 --user-group --no-create-home --home-dir /tmp kvfleet
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH HOME=/tmp PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
USER 1000:1000
EXPOSE 8080
ENTRYPOINT ["kvfleet-router"]
