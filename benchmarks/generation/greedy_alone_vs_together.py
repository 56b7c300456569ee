"""Do a server's greedy answers depend on load? Independent of kiln loadtest: the ``openai`` client
asks each prompt alone, then all of them at once (one thread each), and prints SAME / DIFF.

    python benchmarks/generation/greedy_alone_vs_together.py http://127.0.0.1:8000 --model smollm2

Used to confirm what ``kiln loadtest --check`` reported on SmolLM2 (docs/loadtest-generation.md)."""

from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor

import openai

PROMPTS = ("A man is playing a guitar.", "A woman is slicing an onion.", "Two dogs run on the beach.",
           "The cat sleeps on the sofa.")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    client = openai.OpenAI(base_url=args.url.rstrip("/") + "/v1", api_key="none", max_retries=0, timeout=600)

    def ask(prompt: str) -> str:
        answer = client.chat.completions.create(model=args.model, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=args.max_tokens, temperature=0,
                                                extra_body={"ignore_eos": True})
        return answer.choices[0].message.content or ""

    alone = [ask(p) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(ask, PROMPTS))
    for prompt, a, t in zip(PROMPTS, alone, together):
        print("SAME" if a == t else "DIFF", repr(prompt))
        if a != t:
            print("  alone:   ", repr(a))
            print("  together:", repr(t))


if __name__ == "__main__":
    main()
