"""The serving load through `aaflow serve`: each workflow's agents as OpenAI chat requests.

`aaflow bench serve --http` runs the load's workflows against an `aaflow serve` endpoint on the
deployment, from one asyncio client (the `openai` package's `AsyncOpenAI`): each agent is one
streaming chat request sent once its inputs have answered, its prompt the text `af.run` renders
(parts joined by blank lines, an upstream agent's answer as text), with workflow hints
(`workflow_id`, `agent_id`, `reads`). Rows as `serve_load.run_threads` gives them.

Each load is new to both sides: its requests begin with a line naming the
load ("Batch <8 hex digits>.") and its workflow ids end with it, so that nothing either side
remembers of an earlier load over the same documents helps: no hinted workflow's reference, no
shared prefix aaflow's endpoint knows, no placement or router memory of where a document went (a
server sees new documents and new workflows all the time; both sides' prefix caches are cleared
before each load as well).
"""

from __future__ import annotations

import asyncio
import time
import uuid

from aaflow.benchmarks.baseline_engines import agent_specs


def run_http(base_url: str, model: str, workflows: list, offsets: list[float], ignore_eos: bool,
             hints: bool = True) -> dict:
    """The load, workflow i sent `offsets[i]` s after the start, named as a new load (see the module
    docstring): {"rows", "wall_s"}."""
    return asyncio.run(_load(base_url, model, workflows, offsets, ignore_eos, hints, uuid.uuid4().hex[:8]))


async def _load(base_url, model, workflows, offsets, ignore_eos, hints, batch) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=3600)
    specs = agent_specs({wf.name: wf for wf in workflows})
    begin = time.perf_counter()
    rows = await asyncio.gather(*(_workflow(client, model, specs[wf.name], wf.name, begin + offset, ignore_eos, hints,
                                            batch) for wf, offset in zip(workflows, offsets)))
    await client.close()
    ends = [r["end_s"] for r in rows if "end_s" in r]
    return {"rows": rows, "wall_s": (max(ends) if ends else time.perf_counter()) - begin}


async def _workflow(client, model: str, agents: list[dict], workflow: str, at: float, ignore_eos: bool,
                    hints: bool, batch: str) -> dict:
    await asyncio.sleep(max(0.0, at - time.perf_counter()))
    arrived = time.perf_counter()
    answers: dict[str, asyncio.Future] = {a["name"]: asyncio.get_running_loop().create_future() for a in agents}
    try:
        results = await asyncio.gather(*(_agent(client, model, a, answers, workflow, ignore_eos, hints, arrived, batch)
                                         for a in agents))
    except Exception as exc:  # noqa: BLE001 - counted and reported
        return {"error": f"{type(exc).__name__}: {exc}", "latency_s": time.perf_counter() - arrived}
    ended = time.perf_counter()
    return {"latency_s": ended - arrived, "end_s": ended, "ttft_s": [r["ttft_s"] for r in results],
            "generated": sum(r["completion"] for r in results),
            "prompt_computed": sum(r["prompt"] - r["cached"] for r in results),
            "prompt_reused": sum(r["cached"] for r in results), "texts": {a["name"]: r["text"]
                                                                          for a, r in zip(agents, results)}}


async def _agent(client, model: str, agent: dict, answers: dict, workflow: str, ignore_eos: bool, hints: bool,
                 arrived: float, batch: str) -> dict:
    reads = [p["ref"] for p in agent["prompt"] if isinstance(p, dict)]
    try:
        texts = {name: await answers[name] for name in reads}
        could_start = time.perf_counter() if reads else arrived
        user = "\n\n".join(texts[p["ref"]] if isinstance(p, dict) else p for p in agent["prompt"])
        user, workflow = f"Batch {batch}.\n\n{user}", f"{workflow}/{batch}"
        messages = ([{"role": "system", "content": agent["system"]}] if agent.get("system") else []) + [
            {"role": "user", "content": user}]
        extra = {"ignore_eos": ignore_eos}
        if hints:
            extra["agent_hints"] = {"workflow_id": workflow, "agent_id": agent["name"], "reads": reads}
        stream = await client.chat.completions.create(model=model, messages=messages, max_tokens=agent["max_tokens"],
                                                      temperature=0, stream=True,
                                                      stream_options={"include_usage": True}, extra_body=extra)
        pieces, first, usage = [], None, None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                pieces.append(chunk.choices[0].delta.content)
            usage = chunk.usage or usage
        text = "".join(pieces)
        answers[agent["name"]].set_result(text)
    except BaseException as exc:
        if not answers[agent["name"]].done():
            answers[agent["name"]].set_exception(exc)
        raise
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return {"text": text, "ttft_s": (first or time.perf_counter()) - could_start, "prompt": usage.prompt_tokens,
            "cached": cached or 0, "completion": usage.completion_tokens}


def wait_until_serving(proc, port: int, timeout_s: float = 120.0) -> None:
    """Until `aaflow serve` (the process `proc`) answers `/health` on loopback `port`; RuntimeError,
    with what it printed, if it exits first or `timeout_s` passes."""
    import urllib.request

    deadline = time.time() + timeout_s
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                printed = proc.stdout.read() if proc.stdout and proc.poll() is not None else ""
                raise RuntimeError(f"aaflow serve did not answer on port {port} within {timeout_s:.0f} s "
                                   f"(exit {proc.poll()}): {printed[-3000:]}")
            time.sleep(0.5)


class HttpEndpoint:
    """`aaflow serve` on the deployment at `head` (its `address` and `env`), in a process of its own
    (as a user runs it, with `serve_args` added), on a free loopback port; `clients(ignore_eos)` runs
    a load through it; `close()` stops it."""

    def __init__(self, head, model: str = "smollm2", timeout_s: float = 120.0,
                 serve_args: tuple[str, ...] = ()) -> None:
        import subprocess
        import sys

        from aaflow.benchmarks.ray_head import REPO, free_ports

        self.model, port = model, free_ports(1)[0]
        self.url = f"http://127.0.0.1:{port}/v1"
        self.proc = subprocess.Popen([sys.executable, "-m", "aaflow.cli", "serve", "--address", head.address,
                                      "--port", str(port), *serve_args], env=head.env, cwd=REPO,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_until_serving(self.proc, port, timeout_s)
        except RuntimeError:
            self.close()
            raise

    def clients(self, ignore_eos: bool):
        """A `clients` function for `serve_load.aaflow_load`."""
        return lambda _cluster, workflows, offsets, _strategy, _sample: run_http(self.url, self.model, workflows,
                                                                                 offsets, ignore_eos)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
