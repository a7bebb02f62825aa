"""Write lightning_nvme/data/sample_instructions.jsonl: the instruction set shipped with the package.

Questions and answers about lightning_nvme itself, written from its own definitions: every strategy and
activation-offload argument (its one-line doc and default, from ``lightning_nvme.settings``), every commented
key of the recipes' config groups (``conf/``), each recipe's purpose and launch command (``recipes/``), and the
opening paragraph of each section of ``docs/``. Rerun after those change:

    python tools/make_sample_instructions.py
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from lightning_nvme.activations.settings import ActivationSettings
from lightning_nvme.settings import DDPOffloadSettings, OffloadSettings

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "lightning_nvme" / "data" / "sample_instructions.jsonl"


def plain(doc: str) -> str:
    return doc.replace("``", "`").strip()


def settings_rows() -> list[dict[str, str]]:
    rows = []
    base = {f.name for f in dataclasses.fields(OffloadSettings)}
    groups = [(OffloadSettings, "strategy", "NVMeOffloadStrategy", "nvme_offload"),
              (DDPOffloadSettings, "strategy", "NVMeOffloadDDPStrategy", "nvme_offload_ddp"),
              (ActivationSettings, "callbacks.activation_offload", "NVMeActivationOffload", None)]
    for cls, prefix, owner, strategy in groups:
        for f in dataclasses.fields(cls):
            if cls is DDPOffloadSettings and f.name in base:
                continue
            doc, default = plain(f.metadata.get("doc", "")), f.default
            if not doc:
                continue
            shown = json.dumps(default) if not isinstance(default, str) else default
            rows.append({"instruction": f"What does the `{f.name}` argument of {owner} do?", "input": "",
                         "output": doc})
            rows.append({"instruction": f"What is the default of `{f.name}` in {owner}?", "input": "",
                         "output": f"`{f.name}` defaults to {shown}. {doc}"})
            rows.append({"instruction": f"How do I set `{f.name}` when training with a recipe?", "input": "",
                         "output": f"Add `{prefix}.{f.name}=<value>` to the command line, e.g. "
                                   f"`lightning-nvme train recipe=quickstart {prefix}.{f.name}={shown}`"
                                   + (f" (strategy={strategy})" if strategy == "nvme_offload_ddp" else "")
                                   + f". It is an argument of {owner}: {doc}"})
            rows.append({"instruction": "Which argument of lightning_nvme is described here?", "input": doc,
                         "output": f"`{f.name}` of {owner} (default {shown})."})
    return rows


COMMENTED = re.compile(r"^(\w+):\s*(.*?)\s+#\s*(.+)$")


def conf_rows() -> list[dict[str, str]]:
    rows = []
    for yaml in sorted((ROOT / "conf").glob("*/*.yaml")):
        group, option = yaml.parent.name, yaml.stem
        for line in yaml.read_text().splitlines():
            m = COMMENTED.match(line)
            if not m:
                continue
            key, value, comment = m.groups()
            rows.append({"instruction": f"In the `{group}={option}` config group, what is `{group}.{key}`?",
                         "input": "", "output": f"{comment[0].upper()}{comment[1:]} (default: `{value or 'a group'}`; "
                                                f"set it with `{group}.{key}=...`)."})
    return rows


def recipe_rows() -> list[dict[str, str]]:
    rows = []
    for yaml in sorted((ROOT / "recipes").glob("*.yaml")):
        lines = [ln[1:].strip() for ln in yaml.read_text().splitlines() if ln.startswith("#") and "@package" not in ln]
        text = " ".join(ln for ln in lines if ln and not ln.startswith("lightning-nvme"))
        commands = [ln for ln in lines if ln.startswith("lightning-nvme train")]
        if not text:
            continue
        rows.append({"instruction": f"What is the `{yaml.stem}` recipe for?", "input": "", "output": text})
        if commands:
            rows.append({"instruction": f"How do I launch the `{yaml.stem}` recipe?", "input": "",
                         "output": "Run `" + "`, or `".join(commands) + "`."})
    return rows


def docs_rows() -> list[dict[str, str]]:
    rows = []
    for md in sorted((ROOT / "docs").glob("*.md")):
        title = ""
        for block in re.split(r"\n(?=#)", md.read_text()):
            head, _, body = block.partition("\n")
            if not head.startswith("#"):
                continue
            heading = head.lstrip("# ").strip()
            if head.startswith("# "):
                title = heading
            para = next((p.strip() for p in body.split("\n\n") if p.strip() and not p.strip().startswith(("|", "```", "!["))), "")
            para = " ".join(para.split())
            if len(para) < 60 or len(para) > 900:
                continue
            topic = heading if head.startswith("# ") else f"{heading} ({title})"
            rows.append({"instruction": f"Explain \"{topic}\" in lightning_nvme.", "input": "", "output": para})
    return rows


def main() -> None:
    rows = settings_rows() + conf_rows() + recipe_rows() + docs_rows()
    seen, unique = set(), []
    for r in rows:
        if r["instruction"] + r["input"] not in seen:
            seen.add(r["instruction"] + r["input"])
            unique.append(r)
    with OUT.open("w") as f:
        for r in unique:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"{len(unique)} examples -> {OUT}")


if __name__ == "__main__":
    main()
