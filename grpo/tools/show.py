"""`grpo show RUN_DIR`: read what the model wrote, from the run's rollouts.jsonl.

The terminal view prints one step's logged groups (the last step by default, `--step K`):
each group's prompt and gold answer, then every completion with its reward, reward
components, advantage, length and stop reason; `--best` / `--worst` keep only the highest-
/ lowest-reward completion of each group. `--html OUT.html` writes one self-contained page
(no external files or scripts) with every logged step and group to browse; it refuses a path
that exists or lies in a run or checkpoint directory (`--force` allows it) and never writes
inside the run it reads. Text from data and completions is escaped: control characters
(terminal escape sequences) never reach the terminal, and the page escapes HTML.
"""

from __future__ import annotations

import argparse
import html
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from grpo.tools import paths
from grpo.training.run import run_files
from grpo.training.run.inputs import read_paths

_PROMPT_TAIL = 400
"""Characters of a prompt the terminal shows (its end: the question; --full for all)."""


def add_show_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `grpo show`."""
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory made by `grpo train`")
    parser.add_argument(
        "--step", type=int, default=None, help="the step to print (default: the last logged)"
    )
    choice = parser.add_mutually_exclusive_group()
    choice.add_argument(
        "--best", action="store_true", help="only the highest-reward completion of each group"
    )
    choice.add_argument(
        "--worst", action="store_true", help="only the lowest-reward completion of each group"
    )
    parser.add_argument("--full", action="store_true", help="print whole prompts")
    parser.add_argument(
        "--html", default=None, metavar="OUT.html", help="write every step to one HTML page"
    )
    paths.add_force_argument(parser, "--html file")


def run_show(args: argparse.Namespace) -> int:
    """`grpo show`: print one step's rollouts, or write them all as HTML with --html."""
    run_dir = Path(args.run_dir)
    run_files.read_config(run_dir)  # a clear error when this is no run directory
    if args.html:
        reads = read_paths("RUN_DIR", run_dir)
        paths.check_out(Path(args.html), flag="--html", force=args.force, reads=reads)
    groups = run_files.read_rollouts(run_dir)
    if not groups:
        raise ValueError(
            f"{run_dir} has no {run_files.ROLLOUTS_FILE} rows; train with --log-rollouts N > 0"
        )
    metrics = {
        row[run_files.STEP_KEY]: row
        for row in run_files.merge_rows_by_step(run_files.read_metrics(run_dir))
    }
    if args.html:
        Path(args.html).write_text(render_html(run_dir, groups, metrics), encoding="utf-8")
        steps = sorted({group["step"] for group in groups})
        print(f"wrote {args.html}: {len(steps)} steps, {len(groups)} groups")
        return 0
    steps = sorted({group["step"] for group in groups})
    step = steps[-1] if args.step is None else args.step
    if step not in steps:
        raise ValueError(
            f"--step {step}: {run_dir / run_files.ROLLOUTS_FILE} has steps "
            f"{_ranges(steps)}; pick one of those"
        )
    pick = "best" if args.best else "worst" if args.worst else None
    chosen = [group for group in groups if group["step"] == step]
    try:
        print(render_text(step, chosen, metrics.get(step, {}), pick=pick, full=args.full))
    except BrokenPipeError:  # `grpo show RUN | head`: the reader has what it wanted
        sys.stdout = None
    return 0


def _ranges(steps: Sequence[int]) -> str:
    return f"{steps[0]}..{steps[-1]}" if len(steps) > 3 else ", ".join(map(str, steps))


def _components(completion: Mapping[str, Any]) -> str:
    return ", ".join(f"{name}={value:.4g}" for name, value in completion["components"].items())


def _picked(completions: list[dict[str, Any]], pick: str | None) -> list[tuple[int, dict]]:
    indexed = list(enumerate(completions))
    if pick is None:
        return indexed

    def key(item: Any) -> float:
        return item[1]["reward"]

    return [max(indexed, key=key) if pick == "best" else min(indexed, key=key)]


def _metrics_line(step: int, row: Mapping[str, Any]) -> str:
    keys = ["reward", *sorted(k for k in row if k.startswith("reward/")), "frac_degenerate"]
    parts = [f"{key} {row[key]:.3f}" for key in keys if isinstance(row.get(key), (int, float))]
    return f"step {step}" + (": " + " | ".join(parts) if parts else "")


def render_text(
    step: int,
    groups: Sequence[Mapping[str, Any]],
    row: Mapping[str, Any],
    *,
    pick: str | None = None,
    full: bool = False,
) -> str:
    """One step's groups as terminal text, control characters escaped (`paths.terminal_safe`)."""
    lines = [_metrics_line(step, row), ""]
    for group in groups:
        rewards = [c["reward"] for c in group["completions"]]
        lines.append(
            f"== group {group['group']} | row {group['row']} | gold {group['gold']!r} | "
            f"mean reward {sum(rewards) / len(rewards):.3f}"
            + (" | degenerate (not trained)" if group["degenerate"] else "")
        )
        prompt = group["prompt"]
        if not full and len(prompt) > _PROMPT_TAIL:
            prompt = "..." + prompt[-_PROMPT_TAIL:]
        lines += ["prompt:", *("  " + line for line in prompt.rstrip("\n").split("\n"))]
        for member, completion in _picked(list(group["completions"]), pick):
            lines.append(
                f"  [{member}] reward {completion['reward']:.4g} ({_components(completion)}) | "
                f"advantage {completion['advantage']:+.3f} | {completion['tokens']} tokens | "
                f"stop: {completion['stop_reason']}"
            )
            lines += ["      " + line for line in completion["text"].split("\n")]
        lines.append("")
    return paths.terminal_safe("\n".join(lines).rstrip() + "\n")


_STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:0;display:flex;color:#222}
nav{width:170px;height:100vh;overflow:auto;position:sticky;top:0;background:#f4f4f6;
padding:10px;box-sizing:border-box;border-right:1px solid #ddd}
nav a{display:block;padding:2px 6px;color:#225;text-decoration:none;border-radius:4px}
nav a.on{background:#dde3f5}
main{flex:1;padding:12px 20px;max-width:1100px}
h1{font-size:18px;margin:4px 0 10px}.metrics{color:#555;margin-bottom:10px}
details{border:1px solid #ddd;border-radius:6px;margin:8px 0;padding:4px 10px;background:#fff}
summary{cursor:pointer;font-weight:600}
pre{white-space:pre-wrap;word-break:break-word;margin:4px 0;font:12.5px/1.4 ui-monospace,monospace}
.prompt{background:#f7f7f7;padding:6px;border-radius:4px;color:#444}
table{border-collapse:collapse;width:100%}
td,th{border-top:1px solid #eee;padding:4px 6px;vertical-align:top;text-align:left}
td:last-child{width:48%}
th{font-size:12px;color:#666}.num{white-space:nowrap;font-variant-numeric:tabular-nums}
.good{color:#11772d;font-weight:600}.bad{color:#b3261e}.tag{color:#888;font-weight:400}
"""

_SCRIPT = """
function show(id){document.querySelectorAll('section').forEach(function(s){
s.style.display=(s.id===id)?'':'none'});document.querySelectorAll('nav a').forEach(
function(a){a.className=(a.getAttribute('href')==='#'+id)?'on':''});}
window.addEventListener('hashchange',function(){show(location.hash.slice(1))});
show(location.hash.slice(1)||document.querySelector('section').id);
"""


def _cell(text: Any) -> str:
    return html.escape(paths.terminal_safe(str(text)))


def _group_html(group: Mapping[str, Any]) -> str:
    rewards = [c["reward"] for c in group["completions"]]
    mean = sum(rewards) / len(rewards)
    tag = " <span class='tag'>degenerate: not trained</span>" if group["degenerate"] else ""
    rows = []
    for member, completion in enumerate(group["completions"]):
        reward_class = (
            "good" if completion["reward"] > mean else "bad" if completion["reward"] < mean else ""
        )
        rows.append(
            "<tr>"
            f"<td class='num'>{member}</td>"
            f"<td class='num {reward_class}'>{completion['reward']:.4g}</td>"
            f"<td class='num'>{_cell(_components(completion))}</td>"
            f"<td class='num'>{completion['advantage']:+.3f}</td>"
            f"<td class='num'>{_cell(completion['tokens'])} · "
            f"{_cell(completion['stop_reason'])}</td>"
            f"<td><pre>{_cell(completion['text'])}</pre></td>"
            "</tr>"
        )
    return (
        f"<details open><summary>group {_cell(group['group'])} · row {_cell(group['row'])} · gold "
        f"{_cell(group['gold'])} · mean reward {mean:.3f}{tag}</summary>"
        f"<pre class='prompt'>{_cell(group['prompt'])}</pre>"
        "<table><tr><th>#</th><th>reward</th><th>components</th><th>advantage</th>"
        "<th>tokens · stop</th><th>completion</th></tr>" + "".join(rows) + "</table></details>"
    )


def render_html(
    run_dir: Path, groups: Sequence[Mapping[str, Any]], metrics: Mapping[int, Mapping[str, Any]]
) -> str:
    """Every logged step and group as one self-contained HTML page (inline CSS and script)."""
    steps = sorted({group["step"] for group in groups})
    nav = "".join(f"<a href='#step-{step}'>step {step}</a>" for step in steps)
    sections = []
    for step in steps:
        chosen = [group for group in groups if group["step"] == step]
        sections.append(
            f"<section id='step-{step}'><h1>{_cell(run_dir.name)} · step {step}</h1>"
            f"<div class='metrics'>{_cell(_metrics_line(step, metrics.get(step, {})))}</div>"
            + "".join(_group_html(group) for group in chosen)
            + "</section>"
        )
    title = _cell(f"grpo show {run_dir.name}")
    data = json.dumps({"run_dir": str(run_dir), "steps": steps})
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title>"
        f"<style>{_STYLE}</style></head><body><nav><b>steps</b>{nav}</nav><main>"
        + "".join(sections)
        + f"</main><script type='application/json' id='run'>{html.escape(data)}</script>"
        f"<script>{_SCRIPT}</script></body></html>\n"
    )
