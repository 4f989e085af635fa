"""Generator of trainer/data/corpus.txt, the small English corpus shipped for tests and the demo.

No public-domain book was available offline on the build machine, so the corpus is two short
US-government texts (public domain: the Preamble to the Constitution and the Gettysburg
Address) followed by paragraphs generated here from a small grammar with a fixed seed. The
generated part is ours and dedicated to the public domain (CC0). It is plain English with
repeated structure, so a tiny model's loss falls visibly within a few dozen steps.

Regenerate: `python -m trainer.corpus trainer/data/corpus.txt`.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

PREAMBLE = (
    "We the People of the United States, in Order to form a more perfect Union, establish Justice, "
    "insure domestic Tranquility, provide for the common defence, promote the general Welfare, and "
    "secure the Blessings of Liberty to ourselves and our Posterity, do ordain and establish this "
    "Constitution for the United States of America."
)

GETTYSBURG = (
    "Four score and seven years ago our fathers brought forth on this continent, a new nation, conceived "
    "in Liberty, and dedicated to the proposition that all men are created equal.\n\n"
    "Now we are engaged in a great civil war, testing whether that nation, or any nation so conceived and "
    "so dedicated, can long endure. We are met on a great battle-field of that war. We have come to "
    "dedicate a portion of that field, as a final resting place for those who here gave their lives that "
    "that nation might live. It is altogether fitting and proper that we should do this.\n\n"
    "But, in a larger sense, we can not dedicate -- we can not consecrate -- we can not hallow -- this "
    "ground. The brave men, living and dead, who struggled here, have consecrated it, far above our poor "
    "power to add or detract. The world will little note, nor long remember what we say here, but it can "
    "never forget what they did here. It is for us the living, rather, to be dedicated here to the "
    "unfinished work which they who fought here have thus far so nobly advanced. It is rather for us to be "
    "here dedicated to the great task remaining before us -- that from these honored dead we take "
    "increased devotion to that cause for which they gave the last full measure of devotion -- that we "
    "here highly resolve that these dead shall not have died in vain -- that this nation, under God, shall "
    "have a new birth of freedom -- and that government of the people, by the people, for the people, "
    "shall not perish from the earth."
)

NAMES = ["the miller", "the old sailor", "a young clerk", "the farmer's daughter", "the schoolmaster",
         "a travelling tinker", "the blacksmith", "the widow Grey", "the captain", "a quiet shepherd",
         "the doctor", "the baker's boy", "an old soldier", "the innkeeper", "the lighthouse keeper"]
PLACES = ["the harbour", "the market square", "the edge of the forest", "the mill by the river",
          "the little chapel", "the crossroads", "the station", "the orchard", "the high meadow",
          "the lighthouse", "the bridge", "the village green", "the cellar", "the garden wall"]
TIMES = ["at dawn", "before supper", "in the late afternoon", "on the first cold morning of winter",
         "after the rain", "when the bells rang", "at midnight", "in early spring", "on market day",
         "while the tide was out"]
VERBS = ["walked to", "looked across", "waited at", "hurried past", "returned to", "sat down near",
         "spoke quietly about", "remembered", "painted a picture of", "wrote a letter from"]
OBJECTS = ["a lantern", "an old map", "a basket of apples", "a silver key", "a letter", "a wooden box",
           "a loaf of bread", "a lost dog", "a broken clock", "a bundle of firewood", "a small boat"]
ADJ = ["quiet", "grey", "bright", "cold", "narrow", "crowded", "empty", "ancient", "warm", "windy"]
FEEL = ["glad", "tired", "uneasy", "hopeful", "curious", "patient", "proud", "afraid", "content"]
CONNECT = ["Then", "Later", "After a while", "Soon", "At last", "Meanwhile", "That evening", "By noon"]


def _sentence(r: random.Random) -> str:
    kind = r.randrange(6)
    who, where, when = r.choice(NAMES), r.choice(PLACES), r.choice(TIMES)
    if kind == 0:
        return f"{who.capitalize()} {r.choice(VERBS)} {where} {when}."
    if kind == 1:
        return f"{r.choice(CONNECT)}, {who} found {r.choice(OBJECTS)} near {where}."
    if kind == 2:
        return f"The {r.choice(ADJ)} wind came down over {where}, and {who} felt {r.choice(FEEL)}."
    if kind == 3:
        return f'"Have you seen {r.choice(OBJECTS)}?" asked {who}, and {r.choice(NAMES)} shook their head.'
    if kind == 4:
        n = r.randint(2, 12)
        return f"{who.capitalize()} counted {n} lamps along {where}, one for every year since the war."
    return f"It was {r.choice(ADJ)} {when}, and nobody at {where} spoke of it again."


def generate(paragraphs: int = 800, seed: int = 1863) -> str:
    r = random.Random(seed)
    parts = [PREAMBLE, GETTYSBURG]
    for _ in range(paragraphs):
        parts.append(" ".join(_sentence(r) for _ in range(r.randint(3, 7))))
    return "\n\n".join(parts) + "\n"


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "data" / "corpus.txt")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(generate())
    print(f"wrote {out} ({out.stat().st_size // 1024} KiB)")
