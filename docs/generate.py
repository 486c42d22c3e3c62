"""Writes the generated reference pages of docs/reference/ from the code they describe.

    python docs/generate.py           # rewrite the pages
    python docs/generate.py --check   # exit 1, naming the stale pages, when a page differs

- ``config.md``: every section and key of the configuration file, from the pydantic
  models in :mod:`store.config` (type, default, allowed values, description);
- ``run-spec.md``: every knob of the pipeline's run spec, from :mod:`flows.spec`;
- ``cli.md``: every ``prefill`` command and option, from ``prefill.cli.build_parser()``;
- ``metrics.md``: every Prometheus series, from a fresh ``LoaderMetrics`` registry and
  from the tables of ``store/engines/vllm/prom.py`` (read from its source: that module
  imports vLLM, which only an engine's environment has).

This script is a tool of the repository, not of the product: it lives beside the pages it
writes, is not installed with the packages, and no serving code imports it (see
docs/architecture.md). tests/test_docs.py runs it and fails when a page is stale.
"""
from __future__ import annotations

import argparse
import sys
import typing
from pathlib import Path
from typing import Any, Iterable

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from annotated_types import Ge, Gt, Le, Lt, MaxLen, MinLen  # noqa: E402
from pydantic import BaseModel, ByteSize  # noqa: E402
from pydantic.fields import FieldInfo  # noqa: E402

from docs.metrics_page import metrics_md  # noqa: E402
from docs.page_parts import HEADER, cell as _cell, code as _code  # noqa: E402

OUT = REPO / "docs" / "reference"
TABLE_HEAD = ["| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]


# --- pydantic models -> tables ------------------------------------------------------------

def _type(ann: Any) -> str:
    """A reader's name for a field's annotation."""
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin is typing.Literal:
        return " \\| ".join(_code(str(a)) for a in args)
    if origin is typing.Union:
        rest = [a for a in args if a is not type(None)]
        return " \\| ".join(_type(a) for a in rest) + (" \\| null" if len(rest) < len(args) else "")
    if origin in (tuple, list):
        return f"list of {_type(args[0])}" if args else "list"
    if origin is dict:
        return f"mapping of {_type(args[0])} to {_type(args[1])}"
    if ann is ByteSize:
        return "bytes (`64GiB`, `512MiB`, `2GB` or an integer)"
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return "section"
    return {bool: "boolean", int: "integer", float: "number", str: "string"}.get(ann, getattr(ann, "__name__", str(ann)))


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "(required)"
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "none"
    if isinstance(value, BaseModel):
        return "(below)"
    if isinstance(value, ByteSize):
        return _code(_bytes(int(value)))
    if isinstance(value, bool):
        return _code(str(value).lower())
    if isinstance(value, (tuple, list)):
        return _code("[" + ", ".join(str(v) for v in value) + "]")
    if isinstance(value, dict):
        return _code("{}") if not value else _code(str(value))
    if isinstance(value, float) and value.is_integer() and value >= 1 << 20:
        return _code(_bytes(int(value)) if int(value) % (1 << 20) == 0 else str(int(value)))
    return _code(str(value))


def _bounds(field: FieldInfo) -> str:
    parts = []
    for m in field.metadata:
        for kind, attr, sign in ((Ge, "ge", "≥"), (Gt, "gt", ">"), (Le, "le", "≤"), (Lt, "lt", "<"),
                                 (MinLen, "min_length", "length ≥"), (MaxLen, "max_length", "length ≤")):
            if isinstance(m, kind):
                parts.append(f"{sign} {getattr(m, attr)}")
        pattern = getattr(m, "pattern", None)
        if pattern:
            parts.append(f"matches `{pattern}`")
    return ", ".join(parts)


def _section_model(field: FieldInfo) -> type[BaseModel] | None:
    ann = field.annotation
    for a in (ann, *typing.get_args(ann)):
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a
    return None


def model_tables(model: type[BaseModel], prefix: str = "", level: int = 2) -> list[str]:
    """One heading and table per section of ``model``; nested sections follow their parent."""
    lines = [f"{'#' * level} `{prefix.rstrip('.') or model.__name__}`", ""]
    doc = _cell(model.__doc__ or "")
    if doc:
        lines += [doc, ""]
    lines += TABLE_HEAD
    nested: list[tuple[str, type[BaseModel]]] = []
    for name, field in model.model_fields.items():
        sub = _section_model(field)
        origin = typing.get_origin(field.annotation)
        if sub is not None and origin is dict:
            nested.append((f"{prefix}{name}.<name>.", sub))
        elif sub is not None:
            nested.append((f"{prefix}{name}.", sub))
        lines.append(f"| `{prefix}{name}` | {_type(field.annotation)} | {_default(field)} | {_bounds(field)} "
                     f"| {_cell(field.description or '')} |")
    lines.append("")
    for sub_prefix, sub in nested:
        lines += model_tables(sub, sub_prefix, level + (1 if level < 3 else 0))
    return lines


def config_md() -> str:
    from store.config import CONFIG_ENV, KvwarmConfig

    intro = f"""# Configuration reference

One file for the whole system: YAML (`.yaml`/`.yml`), JSON (`.json`) or TOML (`.toml`),
passed with `--config FILE` (every `prefill` command), the connector's `config` key, or
`${CONFIG_ENV}`; without one, the defaults below apply. Unknown keys are errors (a typo is
never silently ignored), and a bad value fails with a message naming the key, the value and
what is allowed:

```
invalid kvwarm configuration (kvwarm.yaml):
  kv_cache.compression = 'fp4': Input should be 'fp8', 'bf16', 'fp16' or 'fp32'
```

Types are strict: a boolean is never a number (`block_size: true` is an error, not 1), a
quoted `"8"` is a string, not a number, and no number may be `inf` or `nan`; an integer is
fine where a number is asked for. A list in the file is a list key's value.

A key's dotted name is its place in the file: `store.s3.endpoint_url` is `endpoint_url`
under `s3` under `store`. Concepts behind the keys: [blocks and keys](../concepts/blocks-and-keys.md),
[tiers](../concepts/tiers.md), [TTL](../concepts/ttl.md), [tenants](../concepts/tenants.md),
[precision](../concepts/precision.md). Environment variables: [environment.md](environment.md).

"""
    body = []
    # a plain key that the file holds inside a section of mappings (tenants.trust_named): a table of its own first
    placed = {n: f for n, f in KvwarmConfig.model_fields.items() if (f.json_schema_extra or {}).get("section")}
    for name, field in ((n, f) for n, f in KvwarmConfig.model_fields.items() if n not in placed):
        for key, f in ((k, f) for k, f in placed.items() if f.json_schema_extra["section"] == name):  # type: ignore
            body += [f"## `{name}`", "", _cell(field.description or ""), "", *TABLE_HEAD, f"| `{name}.{key}` | "
                     f"{_type(f.annotation)} | {_default(f)} | {_bounds(f)} | {_cell(f.description or '')} |", ""]
        sub = _section_model(field)
        prefix = f"{name}.<name>." if typing.get_origin(field.annotation) is dict else f"{name}."
        body += model_tables(sub, prefix)
    return HEADER.format(source="store/config.py") + intro + "\n".join(body).rstrip() + "\n"


def run_spec_md() -> str:
    from flows.spec import RunSpec

    intro = """# Run spec reference

The pipeline's knobs (`flows.spec.RunSpec`): every flow parameter of `kvwarm_pipeline`, in
sections; each stage flow takes the sections it uses (the
[pipeline guide](../guides/pipeline.md#parameters-the-run-spec-flowsspecpy) lists which).
Prefect validates them before a run starts: a bad value or an unknown key fails the run at
once with the field named. A deployment in `prefect.yaml` gives the same sections as
nested mappings.

"""
    body = []
    for name, field in RunSpec.model_fields.items():
        body += model_tables(_section_model(field), f"{name}.")
    return HEADER.format(source="flows/spec.py") + intro + "\n".join(body).rstrip() + "\n"


# --- argparse -> tables ---------------------------------------------------------------------

def _subcommands(parser: argparse.ArgumentParser) -> Iterable[tuple[str, argparse.ArgumentParser, str]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield name, sub, helps.get(name) or ""


def _option_name(action: argparse.Action) -> str:
    if not action.option_strings:
        return _code(action.metavar or action.dest.upper())
    takes = action.nargs != 0
    metavar = ""
    if takes:
        if action.choices is not None:
            metavar = " {" + ",".join(str(c) for c in action.choices) + "}"
        else:
            metavar = " " + (action.metavar if isinstance(action.metavar, str) else action.dest.upper())
        if action.nargs in ("*", "+"):
            metavar += " ..."
    return ", ".join(_code(o + metavar) for o in action.option_strings)


def _help(action: argparse.Action, prog: str) -> str:
    text = action.help or ""
    if "%" in text:  # argparse %-formats every help string (``%(default)s``, ``%%``)
        params = {k: v for k, v in vars(action).items() if v is not argparse.SUPPRESS}
        params["prog"] = prog
        if params.get("choices") is not None:
            params["choices"] = ", ".join(str(c) for c in params["choices"])
        text = text % params
    return _cell(text)


def _arg_default(action: argparse.Action) -> str:
    if action.required:
        return "(required)"
    d = action.default
    if d is None or d is argparse.SUPPRESS or action.nargs == 0 and d is False:
        return ""
    if isinstance(d, (list, tuple)):
        return _code(",".join(str(v) for v in d)) if d else ""
    return _code(str(d))


def _command_md(path: str, parser: argparse.ArgumentParser, summary: str) -> list[str]:
    anchor_title = f"`{path}`"
    lines = [f"## {anchor_title}", ""]
    text = parser.description or summary or ""
    if issubclass(parser.formatter_class, argparse.RawDescriptionHelpFormatter):
        lines += ["```", text.strip("\n"), "```", ""]
    elif text:
        lines += [_cell(text), ""]
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) or action.help is argparse.SUPPRESS:
            continue
        rows.append(f"| {_option_name(action)} | {_arg_default(action)} | {_help(action, path)} |")
    subs = list(_subcommands(parser))
    if subs:
        lines += ["| command | what it does |", "|---|---|"]
        lines += [f"| [`{path} {name}`](#{_anchor(f'{path} {name}')}) | {_cell(h)} |" for name, _, h in subs]
        lines.append("")
    if rows:
        lines += ["| argument | default | meaning |", "|---|---|---|", *rows, ""]
    if parser.epilog:
        lines += [_cell(parser.epilog), ""]
    for name, sub, h in subs:
        lines += _command_md(f"{path} {name}", sub, h)
    return lines


def _anchor(title: str) -> str:
    """GitHub's anchor of a heading ``# `title` ``."""
    return slug(f"`{title}`")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: lower case, punctuation dropped, spaces to dashes."""
    out = []
    for ch in heading.strip().lower():
        if ch.isalnum() or ch in "-_":
            out.append(ch)
        elif ch == " ":
            out.append("-")
    return "".join(out)


def cli_md() -> str:
    from prefill.cli import build_parser

    parser = build_parser()
    intro = """# Command-line reference

`prefill` is kvwarm's command line (installed with the package; `python -m prefill.cli`
runs the same). Every command that reads a store or a config takes `--store URL` and
`--config FILE` before or after its name; given twice, the later one wins. Exit status:
0 done; 1 an operational failure or a failed check (a tier unreachable, a corrupt
snapshot, a refused access, a deadline passed); 2 bad input or config, printed as one
`prefill: error: ...` line. Anything else is a bug and shows its traceback.

"""
    return HEADER.format(source="prefill.cli.build_parser()") + intro + "\n".join(
        _command_md("prefill", parser, "")).rstrip() + "\n"


PAGES = {"config.md": config_md, "run-spec.md": run_spec_md, "cli.md": cli_md, "metrics.md": metrics_md}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Write (or, with --check, compare) docs/reference's generated pages.")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page differs from the code")
    args = ap.parse_args(argv)
    stale = []
    for name, make in PAGES.items():
        text, path = make(), OUT / name
        if args.check:
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                stale.append(name)
        else:
            path.write_text(text, encoding="utf-8")
    if stale:
        print("stale: " + ", ".join(f"docs/reference/{n}" for n in stale) + "; run python docs/generate.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
