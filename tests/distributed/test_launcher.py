"""The CLI's tensor-parallel launch, end to end: real ``autodeploy`` processes on loopback.

``run --world-size 2`` (this process rank 0, rank 1 a child) and ``torchrun`` with two node
ranks of one process each give the same greedy text as one rank; ``serve --world-size 2``
answers the OpenAI client, streams, and on SIGINT stops with its follower; a follower killed
while the server runs makes it exit 1 with an error naming the rank; Ctrl-C during the build
stops every rank.
"""

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

import httpx
import openai
import pytest

from test_collectives import _free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)
MODEL_ARGS = ["--model", "tiny-llama", "--max_seq_len", "64", "--max_batch_size", "4"]
RUN_ARGS = ["--prompt", "Hello", "--prompt", "The for statement", "--max-tokens", "12", "--ignore-eos"]

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # each builds the model in two processes (~15-30 s)


def _env() -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.setdefault("AUTODEPLOY_CACHE", os.path.join(REPO, ".cache", "autodeploy"))
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return env


class Proc:
    """A command whose stdout and stderr go to files (read while it runs)."""

    def __init__(self, cmd: List[str], env: Optional[Dict[str, str]] = None):
        self.out = tempfile.NamedTemporaryFile(prefix="autodeploy-tp-", suffix=".out", delete=False)
        self.err = tempfile.NamedTemporaryFile(prefix="autodeploy-tp-", suffix=".err", delete=False)
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env or _env(), stdout=self.out, stderr=self.err,
                                     stdin=subprocess.DEVNULL)

    def text(self, which: str = "err") -> str:
        with open((self.err if which == "err" else self.out).name, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def wait_for(self, pattern: str, timeout: float = 240, which: str = "err") -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.search(pattern, self.text(which))
            if found:
                return found
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise AssertionError(f"no {pattern!r} (exit {self.proc.poll()}):\n{self.text('out')[-3000:]}\n"
                             f"{self.text()[-3000:]}")

    def follower_pid(self) -> int:
        return int(self.wait_for(r"started rank 1 of 2 \(pid (\d+)\)").group(1))

    def finish(self, timeout: float = 240) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for f in (self.out, self.err):
            f.close()
            os.unlink(f.name)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not reaped by its parent yet) is gone as far as we care
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _completions(stdout: str) -> List[str]:
    return [line for line in stdout.splitlines() if line.startswith("--- prompt:") or line.startswith(("Hello", "The"))]


@pytest.fixture(scope="module")
def one_rank_output() -> List[str]:
    p = Proc([os.path.join(BIN, "autodeploy"), "run", *MODEL_ARGS, *RUN_ARGS])
    try:
        assert p.finish() == 0, p.text()
        return _completions(p.text("out"))
    finally:
        p.close()


def test_run_world_size_two_starts_its_rank_and_matches_one_rank(one_rank_output):
    p = Proc([os.path.join(BIN, "autodeploy"), "run", "--world-size", "2", *MODEL_ARGS, *RUN_ARGS])
    try:
        follower = p.follower_pid()
        assert p.finish() == 0, p.text()
        assert _completions(p.text("out")) == one_rank_output and len(one_rank_output) == 4
        assert p.text("out").count("transform") >= 1 and "told the other ranks to stop" in p.text()
        assert not _alive(follower)
    finally:
        p.close()


def test_torchrun_with_two_node_ranks_on_loopback_matches_one_rank(one_rank_output):
    port = str(_free_port())
    nodes = [Proc([os.path.join(BIN, "torchrun"), "--nnodes", "2", "--node_rank", str(k), "--nproc-per-node", "1",
                   "--master_addr", "127.0.0.1", "--master_port", port, "-m", "autodeploy.cli", "run", *MODEL_ARGS,
                   *RUN_ARGS]) for k in (0, 1)]
    try:
        codes = [n.finish() for n in nodes]
        assert codes == [0, 0], "\n".join(n.text() for n in nodes)
        assert _completions(nodes[0].text("out")) == one_rank_output
        assert _completions(nodes[1].text("out")) == []  # only rank 0 prints
    finally:
        for n in nodes:
            n.close()


def _serve(extra: List[str] = ()) -> Proc:
    port = _free_port()
    p = Proc([os.path.join(BIN, "autodeploy"), "serve", "--world-size", "2", *MODEL_ARGS, "--port", str(port),
              *extra])
    p.port = port  # type: ignore[attr-defined]
    return p


def _wait_healthy(p: Proc, timeout: float = 240) -> str:
    url = f"http://127.0.0.1:{p.port}"  # type: ignore[attr-defined]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert p.proc.poll() is None, p.text()
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"not healthy:\n{p.text()}")


def test_serve_world_size_two_answers_streams_and_stops_with_its_follower():
    p = _serve()
    try:
        follower = p.follower_pid()
        url = _wait_healthy(p)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        whole = client.completions.create(model="tiny-llama", prompt="The for statement", max_tokens=10,
                                          temperature=0)
        assert whole.usage.completion_tokens == 10 and whole.choices[0].text
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model="tiny-llama", prompt="The for statement", max_tokens=10, temperature=0, stream=True) if c.choices)
        assert streamed == whole.choices[0].text
        # random sampling: only rank 0 samples, so no seed is needed at world size 2
        sampled = client.completions.create(model="tiny-llama", prompt="Hello", max_tokens=6, temperature=1.0, n=2)
        assert len(sampled.choices) == 2
        chat = client.chat.completions.create(model="tiny-llama", max_tokens=5, temperature=0,
                                              messages=[{"role": "user", "content": "hi"}])
        assert chat.choices[0].finish_reason in ("length", "stop")
        assert _alive(follower)
        p.proc.send_signal(signal.SIGINT)
        assert p.finish(timeout=60) == 0, p.text()
        assert "Traceback" not in p.text() and "told the other ranks to stop" in p.text()
        deadline = time.monotonic() + 10
        while _alive(follower) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(follower)
    finally:
        p.close()


def test_a_follower_killed_while_serving_stops_the_server_with_an_error():
    p = _serve()
    try:
        follower = p.follower_pid()
        url = _wait_healthy(p)
        assert httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": "tiny-llama", "prompt": "Hello", "max_tokens": 4}).status_code == 200
        os.kill(follower, signal.SIGKILL)
        start = time.monotonic()
        code = p.finish(timeout=90)
        elapsed = time.monotonic() - start
        err = p.text()
        assert code == 1, err
        assert elapsed < 60, elapsed
        print(f"server exited {elapsed:.1f} s after its follower was killed")
        assert f"autodeploy: error: rank 1 (pid {follower}) was killed by SIGKILL while the deployment was running; " \
               "every rank was stopped" in err
        assert "Traceback" not in err
    finally:
        p.close()


def test_a_follower_killed_mid_stream_ends_the_stream_with_an_error_and_the_server_with_exit_1():
    p = _serve()
    try:
        follower = p.follower_pid()
        url = _wait_healthy(p)
        events: List[str] = []
        with httpx.stream("POST", f"{url}/v1/completions", timeout=60, json={
                "model": "tiny-llama", "prompt": "Hello", "max_tokens": 50, "ignore_eos": True, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
                    if len(events) == 3:
                        os.kill(follower, signal.SIGKILL)
                        start = time.monotonic()
        assert events[-1] == "[DONE]" and "tensor parallelism across 2 ranks failed" in events[-2], events[-2:]
        assert p.finish(timeout=90) == 1, p.text()
        assert time.monotonic() - start < 60
        err = p.text()
        assert f"autodeploy: error: rank 1 (pid {follower}) was killed by SIGKILL" in err
        assert "Traceback" not in err
    finally:
        p.close()


def test_export_world_size_two_builds_every_shard_and_shows_rank_zero_s(tmp_path):
    """`autodeploy export --world-size 2` (before: an error that pointed at run/serve) starts rank
    1, both build their shard, rank 0 prints and writes its graph (all-reduces in it), and
    both leave."""
    p = Proc([os.path.join(BIN, "autodeploy"), "export", "--world-size", "2", *MODEL_ARGS, "--out", str(tmp_path)])
    try:
        follower = p.follower_pid()
        assert p.finish() == 0, p.text()
        histogram = p.text("out").split("ops in the transformed graph:")[1]
        assert re.search(r"\d+\s+autodeploy\.torch_dist_all_reduce", histogram), histogram
        assert p.text("out").count("ops in the transformed graph:") == 1  # rank 1 prints nothing
        assert os.listdir(tmp_path)
        assert not _alive(follower)
    finally:
        p.close()


def test_bench_world_size_two_measures_the_sharded_engine(tmp_path):
    p = Proc([os.path.join(BIN, "autodeploy"), "bench", "--model", "tiny-llama", "--world-size", "2", "--engines",
              "autodeploy", "--batch-sizes", "2", "--new-tokens", "3", "--prefill-lens", "8", "--rounds", "1",
              "--prefill-reps", "1", "--accuracy-prompts", "1", "--accuracy-tokens", "3", "--out", str(tmp_path)])
    try:
        follower = p.follower_pid()
        assert p.finish() == 0, p.text()
        import json

        (result,) = [json.load(open(tmp_path / f)) for f in os.listdir(tmp_path) if f.endswith(".json")]
        assert result["config"]["world_size"] == 2
        row = result["results"]["autodeploy"]
        assert row["decode_tok_s_b2"]["median"] > 0
        assert row["accuracy_vs_hf_eager"]["prompts_equal_hf"] == 1  # the sharded engine's greedy tokens are HF's
        assert not _alive(follower)
    finally:
        p.close()


def test_ctrl_c_while_building_stops_every_rank():
    p = Proc([os.path.join(BIN, "autodeploy"), "run", "--world-size", "2", *MODEL_ARGS, *RUN_ARGS])
    try:
        follower = p.follower_pid()
        p.wait_for(r"joined the gloo group")
        p.proc.send_signal(signal.SIGINT)
        assert p.finish(timeout=30) == 130, p.text()
        assert not _alive(follower)
    finally:
        p.close()
