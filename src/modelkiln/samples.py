"""Built-in sample texts, written for this project, used to validate conversions when no
``--calibration-texts`` file is given and as the default load for ``kiln loadtest``.

They vary on purpose: short and long, casing, punctuation, numbers, code, non-English scripts."""

from __future__ import annotations

SAMPLE_TEXTS: tuple[str, ...] = (
    "Hi!",
    "ok",
    "The quick brown fox jumps over the lazy dog.",
    "THE SERVER WENT DOWN AT 3 AM AND NOBODY NOTICED UNTIL THE MORNING STANDUP.",
    "the kettle boiled twice before anyone remembered the tea",
    "Invoice #4471 totals $1,284.50, due 2025-03-31 (net 30); late fees accrue at 1.5%/month.",
    "Can you reset my password? I've tried three times and the link keeps expiring...",
    "Ich habe gestern im Park einen alten Freund getroffen, und wir haben lange geredet.",
    "Le musée ouvre à neuf heures, mais la file d'attente commence bien avant l'aube.",
    "El tren llegó con cuarenta minutos de retraso por la nieve en la sierra.",
    "東京の天気は明日晴れるでしょう。",
    "Москва — столица России и крупнейший город страны.",
    "Wow... just wow!!! Best. Concert. Ever. 🎸🔥",
    "def add(a, b):\n    return a + b  # simple, but it has a bug when a is None",
    "Patient reports mild headache (2/10) since Tuesday; no fever, BP 120/80, HR 72 bpm.",
    "Marie Curie won Nobel Prizes in both physics and chemistry, in 1903 and 1911.",
    "Apple's new store on Fifth Avenue in New York opens next Friday, the company said.",
    "Angela Merkel met Emmanuel Macron in Berlin to discuss the European Union budget.",
    "I ordered a large pizza with mushrooms, but they delivered a small one with anchovies instead; "
    "when I called the shop, the manager apologised, refunded half the price and promised a free "
    "dessert next time, which honestly made up for most of the disappointment.",
    "Photosynthesis converts light energy into chemical energy: chlorophyll absorbs mostly blue and "
    "red light, water is split to release oxygen, and the captured energy drives the Calvin cycle, "
    "in which carbon dioxide is fixed into three-carbon sugars that the plant later assembles into "
    "glucose, starch and cellulose. Without it, almost every food chain on Earth would collapse.",
    "The committee reviewed 12 proposals, shortlisted 4, and will announce the two winners on June 5th "
    "after a public presentation; each winner receives €25,000 and twelve months of mentoring.",
    "lol no way that's real",
    "Water boils at 100 °C at sea level, but at the top of Mount Everest it boils at roughly 70 °C.",
    "Please find attached the Q3 report. Revenue grew 8.2% year over year, driven by the EMEA region.",
)

# (question, context) pairs for question answering; the contexts are sample texts above.
SAMPLE_QA: tuple[tuple[str, str], ...] = (
    ("Who won Nobel Prizes in physics and chemistry?", SAMPLE_TEXTS[15]),
    ("Where is the new store?", SAMPLE_TEXTS[16]),
    ("Who did Angela Merkel meet?", SAMPLE_TEXTS[17]),
    ("What did the manager promise?", SAMPLE_TEXTS[18]),
    ("What does chlorophyll absorb?", SAMPLE_TEXTS[19]),
    ("How much does each winner receive?", SAMPLE_TEXTS[20]),
    ("At what temperature does water boil on Everest?", SAMPLE_TEXTS[22]),
    ("How much did revenue grow?", SAMPLE_TEXTS[23]),
    ("When is the invoice due?", SAMPLE_TEXTS[5]),
    ("What is the patient's blood pressure?", SAMPLE_TEXTS[14]),
)

# Sentence pairs for pair classification (NLI, rerankers): neighbours in SAMPLE_TEXTS and QA pairs.
SAMPLE_PAIRS: tuple[tuple[str, str], ...] = tuple(
    (SAMPLE_TEXTS[i], SAMPLE_TEXTS[i + 1]) for i in range(0, len(SAMPLE_TEXTS) - 1, 2)
) + SAMPLE_QA[:6]
