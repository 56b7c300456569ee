"""Structured outputs as clients use them: ``client.beta.chat.completions.parse(response_format=
SomePydanticModel)`` against a running server, for 20 pydantic models of varied shape (nested
objects, arrays with bounds, enums and literals, numbers with bounds, optional fields, unions,
recursion), greedy, sampled and streamed; and what the grammar costs in throughput at 16 streams.

The goal: every answer parses (a parsed object every time, in every mode), and constrained
decoding at 16 streams within 10% of unconstrained throughput (``throughput``: as answered, and
with the plain answers made as long as the constrained ones).

    kiln serve artifacts/SmolLM2-135M-Instruct &
    python benchmarks/generation/structured_outputs.py --url http://127.0.0.1:8000 \\
        [--model NAME] [--modes greedy,sampled,streamed] [--seeds 3] [--max-tokens 256] \\
        [--throughput --streams 16 --seconds 30 --rounds 3] [--json out.json]

An answer that does not parse is reported with its reason: the length limit (the model's JSON was
cut at --max-tokens: ``finish_reason`` "length", which a grammar cannot prevent), a refusal, or
invalid JSON (a bug: the grammar allows only valid answers)."""

from __future__ import annotations

import argparse
import enum
import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from typing import Any, Literal, Optional, Union

import pydantic
from pydantic import BaseModel, Field


# --- the 20 models --------------------------------------------------------------------------------


class Colour(str, enum.Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Person(BaseModel):
    name: str
    age: int = Field(ge=0, le=120)


class Address(BaseModel):
    street: str
    city: str
    postcode: str = Field(pattern=r"^[0-9]{5}$")


class PersonWithAddress(BaseModel):
    person: Person
    address: Address


class Book(BaseModel):
    title: str
    authors: list[str] = Field(min_length=1, max_length=3)
    year: int = Field(ge=1450, le=2030)


class Library(BaseModel):
    name: str
    books: list[Book] = Field(min_length=1, max_length=3)


class Sentiment(BaseModel):
    label: Literal["positive", "negative", "neutral"]
    confidence: float = Field(ge=0, le=1)


class Palette(BaseModel):
    primary: Colour
    others: list[Colour] = Field(max_length=3)


class Product(BaseModel):
    sku: str = Field(pattern=r"^[A-Z]{3}-[0-9]{3}$")
    price: float = Field(gt=0, le=10000)
    in_stock: bool
    tags: Optional[list[str]] = None


class Point(BaseModel):
    x: float
    y: float


class Polygon(BaseModel):
    name: str
    vertices: list[Point] = Field(min_length=3, max_length=6)


class Event(BaseModel):
    title: str
    day: int = Field(ge=1, le=31)
    month: int = Field(ge=1, le=12)
    location: Optional[str] = None
    attendees: Optional[int] = Field(default=None, ge=0)


class Recipe(BaseModel):
    dish: str
    servings: int = Field(ge=1, le=12)
    ingredients: list[str] = Field(min_length=1, max_length=6)
    steps: list[str] = Field(min_length=1, max_length=5)


class Step(BaseModel):
    explanation: str
    output: str


class MathReasoning(BaseModel):  # OpenAI's own structured-outputs example
    steps: list[Step] = Field(max_length=4)
    final_answer: str


class Node(BaseModel):
    value: int = Field(ge=0, le=100)
    children: list[Node] = Field(max_length=2)


class Cat(BaseModel):
    kind: Literal["cat"]
    lives: int = Field(ge=0, le=9)


class Dog(BaseModel):
    kind: Literal["dog"]
    good: bool


class Pet(BaseModel):
    name: str
    animal: Union[Cat, Dog] = Field(discriminator="kind")


class Weather(BaseModel):
    city: str
    temperature_c: float = Field(ge=-90, le=60)
    condition: Literal["sunny", "cloudy", "rain", "snow"]
    wind_kmh: Optional[float] = Field(default=None, ge=0)


class Invoice(BaseModel):
    number: int = Field(ge=1)
    customer: Person
    lines: list[Product] = Field(min_length=1, max_length=3)
    paid: bool


class Translation(BaseModel):
    source_language: str
    target_language: str
    text: str


class Classification(BaseModel):
    categories: list[Literal["sports", "politics", "science", "arts", "business"]] = Field(min_length=1, max_length=2)
    summary: str


class Contact(BaseModel):
    name: str
    emails: list[str] = Field(max_length=2)
    phone: Optional[str] = Field(default=None, pattern=r"^\+?[0-9 ]{6,15}$")


class Matrix(BaseModel):
    rows: list[list[int]] = Field(min_length=2, max_length=3)


class Quiz(BaseModel):
    question: str
    options: list[str] = Field(min_length=2, max_length=4)
    answer_index: int = Field(ge=0, le=3)


class Flags(BaseModel):
    verbose: bool
    retries: int = Field(ge=0, le=5)
    mode: Literal["fast", "safe"]
    ratio: float = Field(ge=0, le=1)


# (model, the user's request): the system prompt asks for JSON
CASES: list[tuple[type[BaseModel], str]] = [
    (Person, "Describe a fictional person."),
    (PersonWithAddress, "Give a person and their address in France."),
    (Book, "Describe a famous book."),
    (Library, "Describe a small library with two books."),
    (Sentiment, "Classify the sentiment of: 'I loved this film!'"),
    (Palette, "Pick a colour palette for a website."),
    (Product, "Describe a product in a shop."),
    (Polygon, "Describe a triangle."),
    (Event, "Describe a birthday party."),
    (Recipe, "Give a recipe for pancakes."),
    (MathReasoning, "Solve 8x + 7 = -23 step by step."),
    (Node, "Write a small tree of numbers."),
    (Pet, "Describe a pet."),
    (Weather, "Report the weather in London."),
    (Invoice, "Write an invoice for a customer buying a lamp."),
    (Translation, "Translate 'good morning' into Spanish."),
    (Classification, "Classify: 'The team won the championship final.'"),
    (Contact, "Give the contact details of a plumber."),
    (Matrix, "Write a 2 by 2 identity matrix."),
    (Quiz, "Write a quiz question about planets."),
]
assert len(CASES) == 20 and Flags  # Flags: the throughput run's schema
SYSTEM = "You answer in JSON."


def _ask(client: Any, model: str, case: tuple[type[BaseModel], str], mode: str, seed: int,
         max_tokens: int) -> dict[str, Any]:
    import openai

    schema, question = case
    kw: dict[str, Any] = dict(model=model, messages=[{"role": "system", "content": SYSTEM},
                                                     {"role": "user", "content": question}],
                              response_format=schema, max_tokens=max_tokens)
    if mode != "greedy":
        kw.update(temperature=1.0, seed=seed)
    else:
        kw.update(temperature=0)
    started = time.perf_counter()
    try:
        if mode == "streamed":
            with client.beta.chat.completions.stream(**kw) as stream:
                completion = stream.get_final_completion()
        else:
            completion = client.beta.chat.completions.parse(**kw)
        message = completion.choices[0].message
        ok = isinstance(message.parsed, schema)
        return {"ok": ok, "reason": None if ok else f"refusal: {message.refusal}",
                "tokens": completion.usage.completion_tokens if completion.usage else None,
                "seconds": time.perf_counter() - started}
    except openai.LengthFinishReasonError:
        return {"ok": False, "reason": "length", "seconds": time.perf_counter() - started}
    except (pydantic.ValidationError, json.JSONDecodeError) as exc:
        return {"ok": False, "reason": f"invalid: {str(exc).splitlines()[0][:120]}",
                "seconds": time.perf_counter() - started}


def run_cases(client: Any, model: str, modes: list[str], seeds: int, max_tokens: int) -> list[dict[str, Any]]:
    rows = []
    for schema, question in CASES:
        for mode in modes:
            for seed in range(1 if mode == "greedy" else seeds):
                row = _ask(client, model, (schema, question), mode, seed, max_tokens)
                rows.append({"schema": schema.__name__, "mode": mode, "seed": seed, **row})
                print(f"{schema.__name__:20s} {mode:9s} seed {seed}: "
                      f"{'ok' if row['ok'] else 'FAILED (' + str(row['reason']) + ')'}", flush=True)
    return rows


def throughput(client: Any, model: str, streams: int, seconds: float, rounds: int,
               max_tokens: int) -> dict[str, Any]:
    """Tokens per second at ``streams`` concurrent sampled requests, with and without a schema,
    interleaved by round so that load elsewhere hits both alike. Two comparisons:

    - as answered: the same prompt and seeds, each answer as long as it comes (the constrained
      ones end when their JSON closes, the plain ones at an end token or ``max_tokens``);
    - matched: the plain round replays the constrained round's requests (prompt, seed), each
      made exactly as long as its constrained answer (``ignore_eos``), so that both rounds
      compute the same prefills and the same number of tokens and differ only by the grammar."""
    body = dict(model=model, messages=[{"role": "system", "content": SYSTEM},
                                       {"role": "user", "content": "Give settings for a backup job."}],
                temperature=1.0)
    constrained = {"type": "json_schema", "json_schema": {"name": "Flags", "schema": Flags.model_json_schema(),
                                                          "strict": True}}

    def load(response_format: Any, replay: list[list[tuple[int, int]]] | None = None) -> tuple[float, list, float]:
        """(tokens/s, each worker's (seed, tokens) answers, mean tokens an answer)"""
        stop, lock = time.monotonic() + seconds, threading.Lock()
        answered: list[list[tuple[int, int]]] = [[] for _ in range(streams)]

        def ask(k: int, seed: int, length: int | None) -> None:
            extra: dict[str, Any] = {"response_format": response_format} if response_format else {}
            if length is None:
                extra["max_tokens"] = max_tokens
            else:
                extra.update(max_tokens=length, extra_body={"ignore_eos": True})
            answer = client.chat.completions.create(seed=seed, **body, **extra)
            with lock:
                answered[k].append((seed, answer.usage.completion_tokens))

        def worker(k: int) -> None:
            if replay is not None:
                for seed, length in replay[k]:
                    ask(k, seed, length)
                return
            seed = k * 1000
            while time.monotonic() < stop:
                seed += 1
                ask(k, seed, None)

        started = time.monotonic()
        with ThreadPoolExecutor(streams) as pool:
            list(pool.map(worker, range(streams)))
        lengths = [n for answers in answered for _, n in answers]
        return sum(lengths) / (time.monotonic() - started), answered, statistics.mean(lengths)

    plain, grammar, matched = [], [], []
    plain_len, grammar_len = [], []
    for _ in range(rounds):
        rate, _, length = load(None)
        plain.append(rate)
        plain_len.append(length)
        rate, answered, length = load(constrained)
        grammar.append(rate)
        grammar_len.append(length)
        matched.append(load(None, replay=answered)[0])
    # the median of each round's ratio: the machine's speed drifts between rounds, less within one
    return {"streams": streams, "plain_tok_s": plain, "constrained_tok_s": grammar,
            "ratio": statistics.median(g / p for g, p in zip(grammar, plain)),
            "plain_mean_tokens": plain_len, "constrained_mean_tokens": grammar_len,
            "matched_plain_tok_s": matched, "matched_ratio": statistics.median(g / m for g, m in zip(grammar, matched))}


def main() -> None:
    import openai

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="the served model's name (default: the only one)")
    parser.add_argument("--modes", default="greedy,sampled,streamed")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per sampled or streamed case")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--throughput", action="store_true", help="also measure the grammar's cost at --streams")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    client = openai.OpenAI(base_url=args.url.rstrip("/") + "/v1", api_key="none", max_retries=0, timeout=600)
    model = args.model or client.models.list().data[0].id
    rows = run_cases(client, model, args.modes.split(","), args.seeds, args.max_tokens)
    ok = sum(r["ok"] for r in rows)
    print(f"\n{ok} of {len(rows)} answers parsed ({len(CASES)} schemas, modes {args.modes})")
    for reason in sorted({r["reason"] for r in rows if not r["ok"]}, key=str):
        print(f"  {sum(r['reason'] == reason for r in rows)} x {reason}")
    result: dict[str, Any] = {"date": date.today().isoformat(), "model": model, "answers": rows, "parsed": ok,
                              "total": len(rows)}
    if args.throughput:
        result["throughput"] = t = throughput(client, model, args.streams, args.seconds, args.rounds, 64)
        print(f"{args.streams} streams, as answered: plain {statistics.median(t['plain_tok_s']):.1f} tok/s "
              f"({statistics.median(t['plain_mean_tokens']):.1f} tokens an answer), constrained "
              f"{statistics.median(t['constrained_tok_s']):.1f} tok/s ({statistics.median(t['constrained_mean_tokens']):.1f} "
              f"tokens an answer): x{t['ratio']:.2f} (median of the rounds' ratios)")
        print(f"{args.streams} streams, matched lengths: plain {statistics.median(t['matched_plain_tok_s']):.1f} tok/s, "
              f"constrained x{t['matched_ratio']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
