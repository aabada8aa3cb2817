"""Shared pieces of the server tests: the server process, its clients, SSE and metrics parsing."""

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Dict, Iterator, List, Optional

import httpx
import openai

from autodeploy.models.tokenizer import CHAT_TEMPLATE

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AUTODEPLOY = os.path.join(os.path.dirname(sys.executable), "autodeploy")

MODEL = "tiny-llama"
MAX_SEQ_LEN = 128
# The tests that need work still running when something happens (a disconnect, a SIGTERM, a bad
# request joining the same steps) size it in batches of 8; pinned, not the build-time default.
MAX_BATCH_SIZE = 8
SERVED_NAME = "tiny-served"  # the main server's --served-model-name
MAX_REQUEST_BYTES = 4096  # the main server's --max-request-bytes
API_KEY = "secret"  # the aux server's --api-key
MAX_TOKENS_LIMIT = 32  # the aux server's --max-tokens-limit
SHUTDOWN_TIMEOUT = 20.0  # the aux server's --shutdown-timeout
MAX_CHOICES = 4  # the tight server's --max-choices-per-request (the others keep the default, 128)
TIGHT_PAGES = 12  # the tight server's KV pool: 192 tokens, one 128-token sequence and a bit
TOOLS_MAX_SEQ_LEN = 512  # the tools server's --max_seq_len (its later flag wins over MAX_SEQ_LEN)
# The tools server's --chat_template: the presets' own, after a part that reads chat_template_kwargs
# (``greeting``; "fail" makes the template raise, as templates do on conversations they refuse)
# and documents.
TOOLS_TEMPLATE = (
    "{% if greeting is defined %}{% if greeting == 'fail' %}{{ raise_exception('no such greeting') }}{% endif %}"
    "{{ greeting + '\n' }}{% endif %}"
    "{% for d in documents or [] %}{{ '[doc] ' + d['title'] + '\n' }}{% endfor %}" + CHAT_TEMPLATE
)
TOOLS_TEMPLATE_PATH = os.path.join(tempfile.gettempdir(), f"autodeploy-tests-{os.getuid()}-tools-template.jinja")
if not os.path.exists(TOOLS_TEMPLATE_PATH) or open(TOOLS_TEMPLATE_PATH).read() != TOOLS_TEMPLATE:
    with open(TOOLS_TEMPLATE_PATH + f".{os.getpid()}", "w") as _f:
        _f.write(TOOLS_TEMPLATE)
    os.replace(TOOLS_TEMPLATE_PATH + f".{os.getpid()}", TOOLS_TEMPLATE_PATH)
START_TIMEOUT = 240.0

# A prompt whose greedy continuation does not hit EOS within 100 tokens (checked in test_api).
LONG_PROMPT = "Hello there"

SERVER_ARGS: Dict[str, List[str]] = {
    "main": ["--served-model-name", SERVED_NAME, "--max-request-bytes", str(MAX_REQUEST_BYTES)],
    "aux": ["--api-key", API_KEY, "--max-tokens-limit", str(MAX_TOKENS_LIMIT),
            "--shutdown-timeout", str(SHUTDOWN_TIMEOUT)],
    "tight": ["--transforms.initialize_cache.num_pages", str(TIGHT_PAGES), "--max-choices-per-request", str(MAX_CHOICES)],
    # function calling: the tools the template shows take ~300 of the preset tokenizer's tokens;
    # the priority scheduling policy (requests' 'priority' accepted), requests' own chat templates
    "tools": ["--max_seq_len", str(TOOLS_MAX_SEQ_LEN), "--tool-call-parser", "hermes", "--chat_template",
              TOOLS_TEMPLATE_PATH, "--scheduling_policy", "priority", "--trust-request-chat-template"],
}
FIXTURE_OF = {"server": "main", "aux_server": "aux", "tight_server": "tight", "tools_server": "tools"}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """One ``autodeploy serve`` process; its output goes to a log file (shown on failure)."""

    def __init__(self, name: str, extra: List[str]):
        self.name = name
        self.extra = list(extra)
        self.proc: Optional[subprocess.Popen] = None
        self.port = 0
        self.log_path = ""
        self._log = None

    # ---- lifecycle ---------------------------------------------------------------------------
    def command(self) -> List[str]:
        """The ``autodeploy serve`` command line (``self.port`` is set when it is called)."""
        return [AUTODEPLOY, "serve", "--model", MODEL, "--port", str(self.port),
                "--max_seq_len", str(MAX_SEQ_LEN), "--max_batch_size", str(MAX_BATCH_SIZE), *self.extra]

    def start(self) -> "ServerProcess":
        self.port = free_port()
        fd, self.log_path = tempfile.mkstemp(prefix=f"autodeploy-serve-{self.name}-", suffix=".log")
        self._log = os.fdopen(fd, "wb")
        cmd = self.command()
        env = dict(os.environ)
        env.setdefault("AUTODEPLOY_CACHE", os.path.join(REPO, ".cache", "autodeploy"))
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        env["PYTHONUNBUFFERED"] = "1"
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout: float = START_TIMEOUT) -> "ServerProcess":
        deadline = time.monotonic() + timeout
        retries = 2
        while time.monotonic() < deadline:
            if not self.alive and retries and "address already in use" in self.log_tail().lower():
                retries -= 1  # lost the race for the free port: take another one
                self.stop()
                self.start()
                continue
            if not self.alive:
                raise RuntimeError(f"server '{self.name}' exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"server '{self.name}' not healthy after {timeout}s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self._log is not None:
            self._log.close()
            self._log = None
            if not os.environ.get("AUTODEPLOY_TEST_KEEP_SERVER_LOGS"):
                try:
                    os.unlink(self.log_path)
                except OSError:
                    pass

    def log_text(self) -> str:
        """The whole log so far."""
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def log_tail(self, n: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-n:].decode("utf-8", "replace")
        except OSError:
            return ""

    # ---- clients -----------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def api_key(self) -> str:
        return API_KEY if self.name == "aux" else "unused"

    @property
    def model(self) -> str:
        return SERVED_NAME if self.name == "main" else MODEL

    def headers(self) -> Dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key, max_retries=0,
                             timeout=kw.pop("timeout", 60.0), **kw)

    def async_client(self, **kw) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=self.api_key, max_retries=0,
                                  timeout=kw.pop("timeout", 60.0), **kw)

    def http(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers(), timeout=kw.pop("timeout", 60.0), **kw)

    def metrics(self) -> Dict[str, float]:
        """``/metrics`` parsed into {sample name with labels: value}."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return parse_prometheus(text)

    def wait_idle(self, timeout: float = 5.0) -> Dict[str, float]:
        """Poll /metrics until no pages are held and nothing runs; returns the last sample."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m["autodeploy_kv_pages_used"] == 0 and m["autodeploy_requests_running"] == 0:
                return m
            if time.monotonic() > deadline:
                return m
            time.sleep(0.05)


def parse_prometheus(text: str) -> Dict[str, float]:
    out: Dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, value = line.rsplit(" ", 1)
        out[name] = float(value)
    return out


def sse_events(lines) -> List[str]:
    """The ``data:`` payloads of a server-sent-event stream, in order (``[DONE]`` included)."""
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]


def read_events(lines: Iterator[str], n: int) -> List[str]:
    """The first ``n`` event payloads from an open stream's line iterator (fewer if it ends),
    leaving the rest of the stream unread: for tests that act while a response is in flight."""
    events: List[str] = []
    for line in lines:
        events += sse_events([line])
        if len(events) >= n:
            break
    return events


def json_events(events: List[str]) -> List[dict]:
    return [json.loads(e) for e in events if e != "[DONE]"]


