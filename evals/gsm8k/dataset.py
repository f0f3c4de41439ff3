"""GSM8K data: loaded from a local folder, or downloaded at run time (never at import).

Local layout (the format of github.com/openai/grade-school-math): ``<dir>/test.jsonl`` and
``<dir>/train.jsonl``, one ``{"question": ..., "answer": ...}`` object per line.

Download: the Hugging Face dataset viewer's JSON rows API for ``openai/gsm8k`` (config
``main``), paged 100 rows at a time; the result is cached as JSONL under the cache folder so a
second run needs no network. The base URL can be overridden (tests point it at a local server).
"""

from __future__ import annotations

import json
import os
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import List, Optional

HF_ROWS_URL = "https://datasets-server.huggingface.co/rows"
HF_DATASET = "openai/gsm8k"
HF_CONFIG = "main"
PAGE = 100
DEFAULT_CACHE = os.path.join(
    os.environ.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache")),
    "hisparse",
    "gsm8k",
)


@dataclass(frozen=True)
class Example:
    question: str
    answer: str  # full worked solution ending in "#### <number>"


class DatasetError(RuntimeError):
    pass


def _parse_jsonl(path: str) -> List[Example]:
    out: List[Example] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
                out.append(Example(question=obj["question"], answer=obj["answer"]))
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise DatasetError(f"{path}:{n}: not a GSM8K record ({e})") from None
    return out


def _write_jsonl(path: str, rows: List[Example]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for ex in rows:
            f.write(json.dumps({"question": ex.question, "answer": ex.answer}) + "\n")
    os.replace(tmp, path)


def download_split(
    split: str, limit: Optional[int] = None, *, base_url: str = HF_ROWS_URL, timeout: float = 60.0
) -> List[Example]:
    """Fetch up to `limit` rows (all if None) of a split from the HF rows API."""
    out: List[Example] = []
    offset = 0
    total: Optional[int] = None
    while True:
        want = PAGE if limit is None else min(PAGE, limit - len(out))
        if want <= 0 or (total is not None and offset >= total):
            break
        query = urllib.parse.urlencode(
            {
                "dataset": HF_DATASET,
                "config": HF_CONFIG,
                "split": split,
                "offset": offset,
                "length": want,
            }
        )
        url = f"{base_url}?{query}"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as resp:
                page = json.loads(resp.read().decode("utf-8"))
        except Exception as e:  # noqa: BLE001 - one clear line for any transport error
            raise DatasetError(f"downloading GSM8K {split} from {url} failed: {e}") from None
        rows = page.get("rows", [])
        total = page.get("num_rows_total", total)
        if not rows:
            break
        for r in rows:
            row = r.get("row", r)
            out.append(Example(question=row["question"], answer=row["answer"]))
        offset += len(rows)
    if not out:
        raise DatasetError(f"GSM8K {split}: the server at {base_url} returned no rows")
    return out


def load_split(
    split: str,
    *,
    data_dir: Optional[str] = None,
    limit: Optional[int] = None,
    cache_dir: str = DEFAULT_CACHE,
    base_url: str = HF_ROWS_URL,
) -> List[Example]:
    """Return the first `limit` examples of `split` ('test' or 'train').

    With `data_dir`, read ``<data_dir>/<split>.jsonl`` (an error if it is missing). Otherwise use
    ``<cache_dir>/<split>.jsonl`` if it holds enough rows, else download and cache.
    """
    if split not in ("test", "train"):
        raise ValueError(f"split must be 'test' or 'train', got {split!r}")
    if data_dir is not None:
        path = os.path.join(data_dir, f"{split}.jsonl")
        if not os.path.isfile(path):
            raise DatasetError(f"{path} not found (expected GSM8K {split} split as JSONL)")
        rows = _parse_jsonl(path)
    else:
        path = os.path.join(cache_dir, f"{split}.jsonl")
        rows = _parse_jsonl(path) if os.path.isfile(path) else []
        if (
            not rows
            or (limit is not None and len(rows) < limit)
            or (limit is None and split == "test" and len(rows) < 1319)
        ):
            rows = download_split(
                split, limit=None if limit is None else max(limit, len(rows)), base_url=base_url
            )
            _write_jsonl(path, rows)
    if limit is not None:
        if len(rows) < limit:
            raise DatasetError(
                f"GSM8K {split}: asked for {limit} examples, found {len(rows)} in {path}"
            )
        rows = rows[:limit]
    return rows
