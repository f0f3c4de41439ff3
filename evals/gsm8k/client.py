"""A small OpenAI-compatible client (stdlib urllib) with thread-based concurrency."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence


class ServerError(RuntimeError):
    pass


@dataclass
class Completion:
    text: Optional[str]  # None when the request failed
    error: Optional[str] = None
    latency_s: float = 0.0
    completion_tokens: int = 0


def _post_json(url: str, body: dict, timeout: float) -> dict:
    data = json.dumps(body).encode("utf-8")
    req = urllib.request.Request(
        url, data=data, method="POST", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read().decode("utf-8"))


def _get(url: str, timeout: float) -> tuple:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.status, resp.read().decode("utf-8", "replace")


class OpenAIClient:
    def __init__(self, base_url: str, model: str, timeout: float = 600.0):
        self.base_url = base_url.rstrip("/")
        if self.base_url.endswith("/v1"):
            self.base_url = self.base_url[:-3]
        self.model = model
        self.timeout = timeout

    def served_models(self) -> List[str]:
        _, body = _get(f"{self.base_url}/v1/models", timeout=10)
        return [m["id"] for m in json.loads(body).get("data", [])]

    def scrape_metrics(self, prefix: str = "vllm:hisparse_") -> Dict[str, float]:
        """Sum of every Prometheus sample whose name starts with `prefix`, per metric name
        (label sets summed; a counter's `_total` suffix dropped). {} if /metrics is absent."""
        try:
            _, body = _get(f"{self.base_url}/metrics", timeout=30)
        except (urllib.error.URLError, OSError, ValueError):
            return {}
        out: Dict[str, float] = {}
        for line in body.splitlines():
            if not line.startswith(prefix):
                continue
            name_labels, _, value = line.rpartition(" ")
            name = name_labels.split("{", 1)[0]
            if name.endswith("_created"):
                continue
            if name.endswith("_total"):
                name = name[: -len("_total")]
            try:
                out[name] = out.get(name, 0.0) + float(value)
            except ValueError:
                continue
        return out

    def wait_ready(
        self, max_wait_s: float, poll_s: float = 2.0, alive: Optional[Callable[[], bool]] = None
    ) -> float:
        """Poll /health then /v1/models until the model is listed; returns seconds waited.
        `alive` (if given) is checked each poll, so a crashed server fails fast."""
        start = time.monotonic()
        last = "no answer yet"
        while True:
            waited = time.monotonic() - start
            if alive is not None and not alive():
                raise ServerError(f"server exited during startup after {waited:.0f} s")
            try:
                status, _ = _get(f"{self.base_url}/health", timeout=5)
                if status == 200:
                    models = self.served_models()
                    if self.model in models:
                        return waited
                    last = f"/v1/models lists {models}, not {self.model!r}"
            except urllib.error.HTTPError as e:
                last = f"HTTP {e.code}"
            except (urllib.error.URLError, OSError, ValueError) as e:
                last = str(getattr(e, "reason", e))
            if waited >= max_wait_s:
                raise ServerError(
                    f"server at {self.base_url} not ready after {max_wait_s:.0f} s ({last})"
                )
            time.sleep(min(poll_s, max(0.05, max_wait_s - waited)))

    def complete(
        self, prompt: str, *, max_tokens: int, temperature: float, stop: Sequence[str]
    ) -> Completion:
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "stop": list(stop),
        }
        if temperature == 0.0:
            body["seed"] = 0
        t0 = time.monotonic()
        try:
            out = _post_json(f"{self.base_url}/v1/completions", body, self.timeout)
            text = out["choices"][0]["text"]
            tokens = int(out.get("usage", {}).get("completion_tokens", 0) or 0)
            return Completion(text=text, latency_s=time.monotonic() - t0, completion_tokens=tokens)
        except urllib.error.HTTPError as e:
            detail = e.read().decode("utf-8", "replace")[:200]
            err = f"HTTP {e.code}: {detail}"
        except (KeyError, IndexError, TypeError, ValueError) as e:
            err = f"malformed response: {e}"
        except (urllib.error.URLError, OSError) as e:
            err = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
        return Completion(text=None, error=err, latency_s=time.monotonic() - t0)

    def complete_many(
        self,
        prompts: Sequence[str],
        *,
        max_concurrency: int,
        max_tokens: int,
        temperature: float,
        stop: Sequence[str],
        progress: Optional[Callable[[int, int], None]] = None,
    ) -> List[Completion]:
        """Complete every prompt with at most `max_concurrency` requests in flight; results are
        in prompt order."""
        results: List[Optional[Completion]] = [None] * len(prompts)
        done = [0]
        lock = threading.Lock()

        def one(i: int) -> None:
            results[i] = self.complete(
                prompts[i], max_tokens=max_tokens, temperature=temperature, stop=stop
            )
            with lock:
                done[0] += 1
                if progress is not None:
                    progress(done[0], len(prompts))

        with ThreadPoolExecutor(max_workers=max_concurrency) as pool:
            list(pool.map(one, range(len(prompts))))
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]
