"""The separately built held-out set (v2): hand-written prompts, never used for training.

The templated held-out set (every 20th prompt of the templated route) shares
templates and topics with the training prompts, so its agreement is
in-distribution. This set is written by hand, with wording, quoted passages,
code and follow-ups of its own (tests/unit/test_distill.py checks that it
shares no user turn and no long word run with the training prompts, and none
with the benchmark suite), across categories: explanations, code, rewriting
and summarizing quoted input, multi-turn follow-ups, advice, creative
writing and math. Its purpose is to measure how a draft holds up on prompts
unlike the ones it was built from. It is not the benchmark suite
(benchmarks/prompts/suite-v1.jsonl), which stays unseen by the distillation.

Written to distill/prompt_sets/distill_heldout_v2.jsonl by
`python -m distill.heldout` (with the prompt set); the data stage
generates the target's responses to it (`--heldout-file`), the eval stage
reports agreement on it next to the templated held-out set.
"""
from __future__ import annotations

from pathlib import Path

from distill import prompts
from distill.prompts import DATA_DIR, Messages, Prompt, load, write_jsonl

HELDOUT_V2_FILE = DATA_DIR / "distill_heldout_v2.jsonl"


def _u(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def _a(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


EXPLAIN = [
    "Why do onions make people cry when they are cut?",
    "How does a refrigerator keep food cold?",
    "Could you walk me through how a bill becomes a law in most parliaments?",
    "What actually happens inside a microwave oven when it heats soup?",
    "I never understood why leaves change colour in autumn. What is going on?",
    "How do noise-cancelling headphones work?",
    "What makes sourdough bread taste sour?",
    "Why can't we see stars during the day?",
]

CODE = [
    "I need a Python snippet that counts how many lines in a text file contain the word 'error'.",
    "Please write a small Python class called Counter with increment, decrement and reset methods.",
    "Can you show me a JavaScript function that removes all spaces from a string?",
    "What does this Python line print, and why?\n\nprint([x for x in 'banana' if x != 'a'])",
    "Please tidy up this function, giving the variables clear names:\n\ndef f(a):\n    b = []\n    for c in a:\n"
    "        if c > 0:\n            b.append(c * 2)\n    return b",
    "My function should return the smallest number in a list, but it returns the wrong value for "
    "[5, 3, 8]. What is wrong?\n\ndef smallest(nums):\n    low = nums[0]\n    for n in nums:\n"
    "        if n > low:\n            low = n\n    return low",
    "Turn this into a single line using a generator expression:\n\ntotal = 0\nfor word in words:\n"
    "    total += len(word)",
    "Write a bash command that lists the ten largest files in the current folder.",
]

REWRITE = [
    "Can you make this message sound friendlier?\n\n\"Your invoice is overdue. Pay now.\"",
    "Please reword this so it sounds professional enough for a cover letter:\n\n\"I'm pretty good with "
    "computers and I get stuff done fast.\"",
    "Change this note into plain English without the jargon:\n\n\"We need to leverage our synergies to "
    "move the needle on customer engagement going forward.\"",
    "Could you rewrite this product review so it is more balanced?\n\n\"This phone is the worst thing I "
    "ever bought. The battery dies by noon and the camera is useless.\"",
    "Put this paragraph into the first person:\n\n\"Maria wakes up at six, feeds her cat and cycles to "
    "the bakery where she works. She loves the smell of fresh bread.\"",
    "Edit this text message so my boss will not think I am rude:\n\n\"cant come in today sick\"",
    "Rephrase this announcement for a school newsletter aimed at parents:\n\n\"Starting Monday, the "
    "cafeteria will serve vegetarian options every day and will no longer accept cash.\"",
    "Can you expand these notes into two full sentences?\n\n\"garden club - meets Thursdays 6pm - new "
    "members welcome - bring gloves\"",
]

SUMMARIZE = [
    "Give me the gist of this in a sentence or two:\n\nThe museum's new wing opened on Saturday after "
    "three years of construction. It houses a collection of modern sculpture donated by a local family, "
    "and entry will be free for the first month. Visitors praised the bright galleries but complained "
    "about long queues.",
    "What are the key takeaways here?\n\nA study of two thousand office workers found that those who "
    "took short breaks every hour reported less back pain and higher energy. The researchers suggest "
    "standing up and stretching for two minutes, although they note that the study relied on "
    "self-reported data.",
    "Boil this down to three bullet points:\n\nThe hiking trail will close from June to August for "
    "repairs after spring floods damaged two bridges. Hikers can use the northern loop instead, which is "
    "longer but has better views. Parking at the main entrance remains open.",
    "Can you condense this email for me?\n\nHi Sam, I hope you are well. I wanted to check whether the "
    "slides for Thursday's workshop are ready, because the organisers asked for them by tomorrow "
    "afternoon. If you need help with the charts, I am free this evening. Thanks, Priya",
    "In a few words, what is this paragraph about?\n\nOctopuses have three hearts and blue blood. Two "
    "hearts pump blood to the gills, while the third pumps it to the rest of the body. When an octopus "
    "swims, the third heart stops beating, which may be why they prefer crawling.",
    "Write a short abstract for this:\n\nWe compared three ways of teaching fractions to nine-year-olds: "
    "pizza diagrams, number lines and paper folding. After four weeks, the number-line group scored "
    "highest on a test of comparing fractions, while the paper-folding group enjoyed the lessons most.",
    "Tell me briefly what happened in this story:\n\nA girl finds an old key in her grandmother's attic. "
    "It opens a small box containing letters from a sailor who promised to return. At the end, she "
    "learns the sailor was her great-grandfather, who came home after all.",
    "Sum up this customer complaint so I can log it:\n\nI ordered a blue jacket in size medium on the "
    "third of March. It arrived two weeks late, in the wrong colour, and the return label was missing "
    "from the box. I would like a refund or a replacement as soon as possible.",
]

MULTI_TURN = [
    (_u("What are some easy plants for a dark apartment?"),
     _a("Good choices for low light are snake plants, ZZ plants, pothos and peace lilies. They tolerate "
        "shade, need watering only every one to two weeks, and forgive the occasional mistake."),
     _u("Which one of those is safest if I have a cat?")),
    (_u("How do I start learning to play the piano as an adult?"),
     _a("Start with a simple keyboard, learn where middle C is, and practise scales for ten minutes a day. "
        "A beginner book or an app can guide you through your first songs."),
     _u("Could you condense that to two lines?")),
    (_u("What is a budget?"),
     _a("A budget is a plan for your money: it lists what you expect to earn and how you will spend or "
        "save it over a period, such as a month."),
     _u("Show me what a simple monthly one looks like for a student.")),
    (_u("Tell me about the planet Saturn."),
     _a("Saturn is the sixth planet from the Sun and the second largest. It is a gas giant made mostly of "
        "hydrogen and helium, and it is famous for its bright rings of ice and rock."),
     _u("What would an astronomer add to that?")),
    (_u("Write a sentence about autumn."),
     _a("In autumn, the trees trade their green leaves for shades of red and gold."),
     _u("Nice. Now do one about winter in the same style.")),
    (_u("Why is recycling important?"),
     _a("Recycling saves raw materials and energy, reduces the amount of waste sent to landfills, and "
        "cuts pollution from making new products."),
     _u("Which of those reasons matters most, in your view?")),
    (_u("Can you define the word 'resilient'?"),
     _a("Resilient means able to recover quickly from difficulties or to spring back into shape after "
        "being bent or stretched."),
     _u("Use it in three sentences about different situations.")),
    (_u("What should I pack for a weekend camping trip?"),
     _a("Bring a tent, a sleeping bag and mat, warm layers, a rain jacket, a torch, a first-aid kit, "
        "water, simple food and a small stove."),
     _u("I forgot to say it will be in the desert. What changes?")),
    (_u("Give me a function that doubles a number in Python."),
     _a("Here it is:\n\n```python\ndef double(x):\n    return 2 * x\n```"),
     _u("Can you make it work on a whole list as well?")),
    (_u("How long should I boil an egg?"),
     _a("About six minutes for a soft yolk and nine to ten minutes for a firm, hard-boiled egg, starting "
        "from boiling water."),
     _u("And if I am at high altitude?")),
]

ADVICE = [
    "My roommate never does the dishes. How can I bring it up without starting a fight?",
    "I have two job offers, one pays more and one is closer to home. How should I decide?",
    "What is a sensible way to split chores among three teenagers?",
    "I get nervous before phone calls. Any tricks to feel calmer?",
    "How should I prepare my bike for riding in winter?",
    "I keep forgetting people's names right after I meet them. What helps?",
    "My laptop is getting slow. What can I check before buying a new one?",
    "What should a first-time voter know before election day?",
]

CREATIVE = [
    "Invent a name and a one-line slogan for a bakery run by a family of owls.",
    "Write four lines of a lullaby for a baby dragon.",
    "Describe a rainy market street using all five senses.",
    "Write a short note that a lighthouse keeper might leave for the next keeper.",
    "Come up with a riddle whose answer is 'a shadow'.",
    "Write a two-sentence horror story set in a library.",
    "Imagine a holiday that does not exist yet. What is it called and how do people celebrate it?",
    "Write a toast for the retirement party of a school bus driver.",
]

MATH = [
    "A bag holds 4 red and 6 blue marbles. If I pick one without looking, what is the chance it is red?",
    "Tom reads 15 pages a day. His book has 240 pages. After how many days will he finish it?",
    "Round 3.14159 to three decimal places and explain the rule you used.",
    "A phone plan costs $12 a month plus $0.05 per text. How much is a month with 300 texts?",
    "What is 15% of 240? Please show the steps.",
    "If a pizza is cut into 8 slices and 3 friends eat 2 slices each, what fraction is left?",
    "The temperature was -4 degrees in the morning and rose by 11 degrees. What was it in the afternoon?",
    "Convert 2.5 hours into minutes and seconds.",
]

CATEGORIES: dict[str, list] = {
    "explain": EXPLAIN, "code": CODE, "rewrite": REWRITE, "summarize": SUMMARIZE,
    "multi-turn": MULTI_TURN, "advice": ADVICE, "creative": CREATIVE, "math": MATH,
}


def _messages(item: str | tuple[dict[str, str], ...]) -> Messages:
    """A single-turn prompt from a string, a conversation as written."""
    return (_u(item),) if isinstance(item, str) else tuple(item)


def build() -> list[Prompt]:
    """Every hand-written held-out prompt, grouped by category, ids from 0, all held out."""
    items = [(category, _messages(item)) for category, group in CATEGORIES.items() for item in group]
    return [Prompt(i, category, messages, True) for i, (category, messages) in enumerate(items)]


def write(path: Path = HELDOUT_V2_FILE) -> int:
    return write_jsonl(build(), path)


def load_v2(path: Path = HELDOUT_V2_FILE) -> list[Prompt]:
    """The v2 held-out prompts (every row counts as held out, whatever its flag)."""
    return [Prompt(p.id, p.category, p.messages, True) for p in load(path)]


def main() -> None:
    """Rewrite the shipped prompt set (distill.prompts) and this held-out set from their modules."""
    print(f"wrote {prompts.write()} prompts to {prompts.PROMPTS_FILE}")
    print(f"wrote {write()} held-out prompts to {HELDOUT_V2_FILE}")


if __name__ == "__main__":
    main()
