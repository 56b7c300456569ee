"""Tool calls as clients make them: the unmodified ``openai`` client, ``tool_choice`` "required" and a
named function, streamed and not, greedy and sampled, against a running server whose model's
chat template takes tools (Qwen2.5-Instruct's). Every call's arguments must parse against its
function's schema (pydantic validates them), every time.

    python benchmarks/generation/chat/tool_calls.py --url http://127.0.0.1:8000 --model qwen [--seeds 5] [--json out.json]

A random-weight model (benchmarks/generation/model_shapes.py) is enough: the grammar, not the
weights, makes the call parse; the weights decide only what the arguments say."""

from __future__ import annotations

import argparse
import json
from datetime import date
from typing import Annotated, Literal, Optional

import openai
from pydantic import BaseModel, Field, StringConstraints, ValidationError


# Strings have a maxLength: a random-weight model rarely chooses a closing quote, and an unbounded
# string would run to max_tokens (the grammar bounds what it can, the length of free text it cannot).
Name = Annotated[str, StringConstraints(max_length=24)]


class GetWeather(BaseModel):
    city: Name
    unit: Literal["celsius", "fahrenheit"] = "celsius"


class SearchFlights(BaseModel):
    origin: str = Field(min_length=3, max_length=3)
    destination: str = Field(min_length=3, max_length=3)
    passengers: int = Field(ge=1, le=9)
    cabin: Optional[Literal["economy", "business"]] = None
    dates: list[Annotated[str, StringConstraints(pattern=r"^2026-[01][0-9]-[0-3][0-9]$")]] = Field(min_length=1,
                                                                                                   max_length=2)


class CreateEvent(BaseModel):
    title: Name
    attendees: list[Name] = Field(max_length=4)
    duration_minutes: float = Field(gt=0, le=480)
    private: bool


FUNCTIONS = {"get_weather": GetWeather, "search_flights": SearchFlights, "create_event": CreateEvent}
TOOLS = [{"type": "function", "function": {"name": name, "description": model.__doc__ or name,
                                           "parameters": model.model_json_schema(), "strict": True}}
         for name, model in FUNCTIONS.items()]
PROMPTS = ["What is the weather in Oslo?", "Find me a flight from OSL to JFK next Friday for two.",
           "Put a 30-minute sync with Ana and Bo on my calendar."]


def check_calls(calls: list[tuple[str, str]], named: str | None) -> str | None:
    """None when every (name, arguments) parses against its function's schema, else why not."""
    if not calls:
        return "no tool call"
    for name, arguments in calls:
        if name not in FUNCTIONS:
            return f"unknown function {name!r}"
        if named is not None and name != named:
            return f"called {name!r}, asked for {named!r}"
        try:
            FUNCTIONS[name].model_validate_json(arguments)
        except ValidationError as exc:
            return f"{name} arguments do not parse: {str(exc).splitlines()[0]}"
    return None


def one(client: openai.OpenAI, model: str, prompt: str, choice: str, stream: bool, seed: int | None,
        max_tokens: int) -> dict:
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": choice}}
    kw = dict(model=model, messages=[{"role": "user", "content": prompt}], tools=TOOLS, tool_choice=tool_choice,
              max_tokens=max_tokens, temperature=0.0 if seed is None else 0.9, seed=seed)
    if not stream:
        answer = client.chat.completions.create(**kw).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in answer.message.tool_calls or []]
        finish = answer.finish_reason
    else:
        pieces: dict[int, list[str]] = {}
        finish = None
        for chunk in client.chat.completions.create(stream=True, **kw):
            for c in chunk.choices:
                finish = c.finish_reason or finish
                for call in c.delta.tool_calls or []:
                    entry = pieces.setdefault(call.index, ["", ""])
                    entry[0] += (call.function.name or "") if call.function else ""
                    entry[1] += (call.function.arguments or "") if call.function else ""
        calls = [(name, args) for name, args in (pieces[i] for i in sorted(pieces))]
    why = check_calls(calls, None if choice == "required" else choice)
    if why is None and finish != "tool_calls":
        why = f"finish_reason {finish!r}"
    return {"prompt": prompt, "choice": choice, "stream": stream, "seed": seed, "calls": len(calls),
            "ok": why is None, "why": why}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", required=True)
    parser.add_argument("--seeds", type=int, default=3, help="sampled answers per case (besides the greedy one)")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    client = openai.OpenAI(base_url=args.url + "/v1", api_key="none", max_retries=0, timeout=600)
    rows = []
    for prompt in PROMPTS:
        for choice in ["required", *FUNCTIONS]:
            for stream in (False, True):
                for seed in [None, *range(args.seeds)]:
                    row = one(client, args.model, prompt, choice, stream, seed, args.max_tokens)
                    rows.append(row)
                    print(f"{choice:15s} {'streamed' if stream else 'whole':8s} seed {seed!s:4s} "
                          f"{prompt[:30]!r:34s} {'ok' if row['ok'] else 'FAILED: ' + row['why']}", flush=True)
    ok = sum(r["ok"] for r in rows)
    print(f"\n{ok} of {len(rows)} answers were tool calls whose arguments parse against the schema")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": date.today().isoformat(), "model": args.model, "ok": ok, "total": len(rows),
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
