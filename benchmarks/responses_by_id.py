"""What previous_response_id saves: a conversation continued by id against its whole input resent.

A store, one worker of --model (SmolLM2-135M by default) and the gateway, each a process.
Two agents hold the same greedy conversation of --turns questions through OpenAI's
Responses API: one is sent its whole input each call, the other only the new question
after its last response's id. The replies must be equal, token for token. The table gives,
per turn, the request body's bytes, the first token's time as the worker measured it, the
call's wall time, and the cached tokens. Then the by-id conversation goes on after the
gateway, and then the worker, were restarted (the id is all the client kept), and branches
from its first response (a fork of the agent).
Run: python benchmarks/responses_by_id.py [--model SPEC] [--turns 8] [--max-tokens 24]
"""

from __future__ import annotations

import json
import time

import harness as h

SYSTEM = "You are the archivist of a small mountain library. Answer briefly."
ASKS = [
    "Which scrolls came in today?", "Index them.", "Which is oldest?", "Who wrote it?",
    "Where should it be kept?", "How should it be cleaned?", "Summarize what we decided.",
    "What is left to do?",
]  # fmt: skip


class Gateway:
    """The gateway process in front of the services' worker, restartable."""

    def __init__(self, svc, root) -> None:
        self.svc, self.root, self.process = svc, root, None

    def client(self):
        import openai

        from agentkv.launch import gateway_process

        if self.process is None:
            address, flags = [self.svc.addresses["w"]], ["--model-name", "m"]
            self.process = gateway_process(address, self.root / "gateway.log", extra_args=flags)
            self.svc.start(self.process)
        url = f"http://{self.process.address}/v1"
        return openai.OpenAI(base_url=url, api_key="unused", max_retries=0)

    def restart(self) -> None:
        self.process.stop()
        self.process = None


def call(client, body: dict, **extra) -> tuple[dict, object]:
    """One Responses call: its row figures (bytes, TTFT ms, wall ms, cached) and the reply."""
    start = time.perf_counter()
    reply = client.responses.create(**body, **extra)
    wall = (time.perf_counter() - start) * 1e3
    facts = reply.model_extra["agentkv"]
    return {
        "bytes": len(json.dumps(body)),
        "ttft_ms": facts["time_to_first_token_ms"],
        "wall_ms": wall,
        "cached": reply.usage.input_tokens_details.cached_tokens,
        "input": reply.usage.input_tokens,
        "state": facts["cache_state"],
    }, reply


def conversation(client, args) -> tuple[list, object, object]:
    """--turns turns both ways: rows, the by-id's first and last replies."""
    items, rows, first, last = [], [], None, None
    base = {"model": "m", "instructions": SYSTEM, "max_output_tokens": args.max_tokens}
    base["temperature"] = 0
    for n, ask in enumerate(ASKS[: args.turns], 1):
        items.append({"role": "user", "content": ask})
        whole, resent = call(
            client, base | {"input": list(items)}, extra_headers={"X-Agent-Id": "whole"}
        )
        by_id = base | {"input": ask} | ({"previous_response_id": last.id} if last else {})
        cont, last = call(client, by_id, extra_headers=None if first else {"X-Agent-Id": "by-id"})
        first = first or last
        if last.output_text != resent.output_text:
            raise SystemExit(
                f"turn {n}: the replies differ: {last.output_text!r} {resent.output_text!r}"
            )
        rows.append((n, whole["input"], whole["bytes"], cont["bytes"], h.fmt(whole["ttft_ms"]),
                     h.fmt(cont["ttft_ms"]), h.fmt(whole["wall_ms"], 0), h.fmt(cont["wall_ms"], 0),
                     whole["cached"], cont["cached"]))  # fmt: skip
        items += [item.model_dump(exclude_none=True) for item in resent.output]
    return rows, first, last


def main(argv: list[str] | None = None) -> None:
    p = h.parser(__doc__, quick={"turns": 3, "max_tokens": 12})
    p.add_argument("--turns", type=int, default=8, choices=range(1, len(ASKS) + 1))
    p.add_argument("--max-tokens", type=int, default=24)
    args = p.parse_args(argv)
    h.open_model(args)
    with h.services(None, args.path, {"w": []}) as svc:
        gateway = Gateway(svc, svc.root)
        rows, first, last = conversation(gateway.client(), args)
        base = {"model": "m", "instructions": SYSTEM, "max_output_tokens": args.max_tokens}
        base["temperature"], then = 0, []
        gateway.restart()
        after, last = call(
            gateway.client(), base | {"input": "Thanks.", "previous_response_id": last.id}
        )
        then.append(("after a gateway restart", after))
        svc.workers["w"].close()
        svc.processes["w"].stop()  # SIGTERM: its writes finish; the store keeps the agent
        svc.start_worker("w", args.path)
        gateway.restart()
        after, last = call(
            gateway.client(), base | {"input": "Once more.", "previous_response_id": last.id}
        )
        then.append(("after a worker restart", after))
        after, _ = call(
            gateway.client(), base | {"input": "Burn them.", "previous_response_id": first.id}
        )
        then.append(("a branch from the first response (a fork)", after))
    sections = [
        ("the same conversation: whole input resent, and by previous_response_id", h.table(
            ["turn", "context tokens", "body bytes, whole", "body bytes, by id", "TTFT ms, whole",
             "TTFT ms, by id", "call ms, whole", "call ms, by id", "cached, whole",
             "cached, by id"], rows)),
        ("continued by id only", h.table(
            ["after", "context tokens", "cache", "TTFT ms", "call ms", "cached"],
            [(what, r["input"], r["state"], h.fmt(r["ttft_ms"]), h.fmt(r["wall_ms"], 0),
              r["cached"]) for what, r in then])),
    ]  # fmt: skip
    header = {"model": args.described, "machine": h.machine()}
    document = {"turns": rows, "continued": then}
    h.report("responses_by_id", args.out, header, sections, document=document)


if __name__ == "__main__":
    main()
