"""`hstu submit` against a small local HTTP server that answers the Kubeflow Pipelines REST
calls kfp.Client makes, and records them."""
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import pytest
import yaml

from pipelines.cli import main as hstu

API = "/apis/v2beta1"


class FakePipelines:
    """The state of a KFP endpoint: pipelines by name, experiments, runs; each request's
    (method, path, query, body, authorization) is recorded in `calls`."""

    def __init__(self, final_state: str = "SUCCEEDED"):
        self.pipelines, self.versions, self.experiments, self.runs = {}, {}, {}, {}
        self.calls, self.final_state = [], final_state

    def answer(self, method: str, path: str, query: dict, body: bytes) -> tuple[int, dict]:
        if method == "GET" and path == f"{API}/healthz":
            return 200, {"multi_user": False}
        if method == "GET" and path == f"{API}/pipelines":
            name = json.loads(query["filter"][0])["predicates"][0]["stringValue"]
            return 200, ({"pipelines": [self.pipelines[name]], "total_size": 1} if name in self.pipelines else {})
        if method == "POST" and path in (f"{API}/pipelines/upload", f"{API}/pipelines/upload_version"):
            assert b"pipelineSpec" in body or b"pipeline_spec" in body or b"deploymentSpec" in body  # the compiled YAML
            name = query["name"][0]
            if path.endswith("upload"):
                self.pipelines[name] = {"pipeline_id": f"p{len(self.pipelines) + 1}", "display_name": name}
                pipeline_id = self.pipelines[name]["pipeline_id"]
            else:
                pipeline_id = query["pipelineid"][0]
            version = {"pipeline_id": pipeline_id, "pipeline_version_id": f"v{len(self.versions) + 1}", "display_name": name}
            self.versions[version["pipeline_version_id"]] = version
            return 200, self.pipelines[name] if path.endswith("upload") else version
        if method == "GET" and path.startswith(f"{API}/pipelines/") and path.endswith("/versions"):
            pipeline_id = path.split("/")[-2]
            mine = [v for v in self.versions.values() if v["pipeline_id"] == pipeline_id]
            return 200, {"pipeline_versions": mine[-1:], "total_size": len(mine)}
        if method == "GET" and path == f"{API}/experiments":
            name = json.loads(query["filter"][0])["predicates"][0]["stringValue"]
            found = [e for e in self.experiments.values() if e["display_name"] == name]
            return 200, ({"experiments": found, "total_size": 1} if found else {})
        if method == "POST" and path == f"{API}/experiments":
            experiment = json.loads(body) | {"experiment_id": f"e{len(self.experiments) + 1}"}
            self.experiments[experiment["experiment_id"]] = experiment
            return 200, experiment
        if method == "POST" and path == f"{API}/runs":
            run = json.loads(body) | {"run_id": f"r{len(self.runs) + 1}", "state": "PENDING"}
            self.runs[run["run_id"]] = run
            return 200, run
        if method == "GET" and path.startswith(f"{API}/runs/"):
            run = self.runs[path.split("/")[-1]]
            run["state"] = "RUNNING" if run["state"] == "PENDING" else self.final_state
            return 200, run
        return 404, {"error": f"no {method} {path}", "code": 5}


@pytest.fixture
def endpoint():
    state = FakePipelines()

    class Handler(BaseHTTPRequestHandler):
        def _serve(self, method):
            url = urlparse(self.path)
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            query = parse_qs(url.query)
            state.calls.append((method, url.path, query, body, self.headers.get("Authorization")))
            code, answer = state.answer(method, url.path, query, body)
            data = json.dumps(answer).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._serve("GET")

        def do_POST(self):
            self._serve("POST")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", state
    server.shutdown()


def test_submit_uploads_then_adds_versions_starts_runs_and_waits(endpoint, monkeypatch, capsys):
    url, state = endpoint
    monkeypatch.setenv("KFP_TOKEN", "secret-token")
    monkeypatch.setattr("pipelines.submit.time.sleep", lambda s: None)
    args = ["submit", "--host", url, "--param", "work_dir=/workspace/run1", "--param", "epochs=3",
            "--param", "launcher=trainjob", "--experiment", "recsys", "--run-name", "first"]
    assert hstu(args + ["--wait"]) == 0
    out = capsys.readouterr().out
    assert f"run r1: {url}/#/runs/details/r1" in out and "run r1: SUCCEEDED" in out
    run = state.runs["r1"]
    assert run["display_name"] == "first" and run["experiment_id"] == "e1"
    assert run["pipeline_version_reference"] == {"pipeline_id": "p1", "pipeline_version_id": "v1"}
    assert run["runtime_config"]["parameters"] == {"work_dir": "/workspace/run1", "epochs": 3, "launcher": "trainjob"}
    uploaded = next(c for c in state.calls if c[1].endswith("/pipelines/upload"))
    assert "deploymentSpec" in yaml.safe_load(uploaded[3].split(b"\r\n\r\n", 1)[1].rsplit(b"\r\n--", 1)[0])
    assert {c[4] for c in state.calls} == {"Bearer secret-token"}

    # the same pipeline again: a new version of it, the same experiment, a second run
    assert hstu(["submit", "--host", url, "--param", "work_dir=/workspace/run2", "--experiment", "recsys"]) == 0
    assert len(state.pipelines) == 1 and len(state.experiments) == 1
    assert state.runs["r2"]["pipeline_version_reference"] == {"pipeline_id": "p1", "pipeline_version_id": "v2"}

    state.final_state = "FAILED"
    assert hstu(["submit", "--host", url, "--param", "work_dir=/w", "--wait"]) == 1
    with pytest.raises(SystemExit) as e:
        hstu(["submit", "--host", url, "--param", "no-equals-sign"])
    assert e.value.code == 1 and "expected KEY=VALUE" in capsys.readouterr().err
