"""The shipped distillation prompt set: varied single-turn chat tasks.

Built deterministically from templates x topics (explanations, creative
writing, code, arithmetic word problems, rewriting, advice, comparisons,
emails, ...) and checked in as specdec/data/distill_prompts.jsonl, so every
run of `python -m specdec.distill` sees the same prompts in the same order.
Every 20th prompt (after a seeded shuffle) is held out for evaluation.

Regenerate with `python -m specdec.distill.prompts` (the test suite checks
that the file matches this module).
"""
from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PROMPTS_FILE = Path(__file__).resolve().parent.parent / "data" / "distill_prompts.jsonl"
SEED = 20261129
HELDOUT_EVERY = 20

TOPICS = [
    "photosynthesis", "black holes", "the water cycle", "compound interest", "vaccines",
    "climate change", "machine learning", "volcanoes", "the stock market", "sleep",
    "bread baking", "chess openings", "coral reefs", "the Roman Empire", "the French Revolution",
    "plate tectonics", "the immune system", "electric cars", "renewable energy", "honeybees",
    "the internet", "blockchain", "the Moon landing", "DNA", "gravity", "rainbows",
    "inflation", "supply and demand", "the printing press", "jazz music", "impressionist painting",
    "meditation", "marathon training", "composting", "recycling", "the human heart",
    "antibiotics", "quantum computing", "solar panels", "the Great Wall of China", "the Amazon rainforest",
    "octopuses", "tea ceremonies", "public libraries", "urban gardening", "time zones",
    "the Olympic Games", "earthquakes", "hurricanes", "the Silk Road", "ancient Egypt",
    "the periodic table", "probability", "prime numbers", "the Pythagorean theorem", "cloud computing",
    "password security", "open source software", "remote work", "bicycles", "coffee",
    "chocolate", "dinosaurs", "the solar system", "Mars exploration", "ocean tides",
    "the nervous system", "friendship", "procrastination", "public speaking", "budgeting",
    "nutrition", "hydration", "minimalism", "board games", "origami", "photography",
    "the history of writing", "democracy", "the scientific method", "bridges", "airplanes",
    "trains", "lighthouses", "glaciers", "deserts", "penguins", "wolves", "mushrooms",
    "the color blue", "libraries of the future", "artificial intelligence ethics", "robots",
    "the Renaissance", "the Industrial Revolution", "the Cold War", "the Maya civilization", "Vikings",
    "samurai", "the Ottoman Empire", "ancient Greece", "the printing of money", "the gold standard",
    "credit scores", "mortgages", "index funds", "cryptocurrency", "small business taxes",
    "the theory of evolution", "cells", "photosynthesis in the ocean", "the human brain", "memory",
    "habits", "motivation", "empathy", "negotiation", "leadership", "teamwork", "job interviews",
    "resumes", "email etiquette", "time management", "the Pomodoro technique", "note taking",
    "speed reading", "learning styles", "online courses", "homeschooling", "museums",
    "classical music", "hip hop", "the guitar", "the piano", "film editing", "animation",
    "video games", "virtual reality", "smartphones", "batteries", "nuclear power", "wind turbines",
    "hydroelectric dams", "water purification", "soil erosion", "bees and pollination", "forests",
    "wetlands", "the Arctic", "the Sahara desert", "the Himalayas", "rivers", "islands", "caves",
    "weather forecasting", "lightning", "snowflakes", "the northern lights", "comets", "telescopes",
    "the International Space Station", "satellites", "GPS", "maps", "the metric system", "calendars",
    "clocks", "the history of medicine", "vaccines for children", "first aid", "yoga", "stretching",
    "strength training", "vegetarian cooking", "fermentation", "spices", "pizza", "sushi", "tea",
    "cheese making", "beekeeping", "knitting", "woodworking", "pottery", "calligraphy", "gardening tools",
    "houseplants", "cats", "dogs", "horses", "elephants", "whales", "sharks", "butterflies", "ants",
    "birds migration", "the Internet of Things", "databases", "encryption", "compilers", "operating systems",
    "version control", "unit testing", "APIs", "web browsers", "search engines", "social media",
    "misinformation", "privacy", "copyright", "voting", "the United Nations", "city planning",
    "public transport", "electric scooters", "architecture", "skyscrapers", "castles", "pyramids",
]

TOPIC_TEMPLATES = [
    "Explain {t} in simple terms.",
    "Explain {t} to a ten-year-old.",
    "Write a short poem about {t}.",
    "Write a haiku about {t}.",
    "Give me three interesting facts about {t}.",
    "Summarize the key ideas of {t} in three bullet points.",
    "What is a common misconception about {t}?",
    "Write the opening paragraph of a blog post about {t}.",
    "Create a multiple-choice quiz question about {t}, with the answer.",
    "How would you teach {t} to a complete beginner?",
    "Write a tweet about {t}.",
    "Give a brief history of {t}.",
    "List five words related to {t} and define each one.",
    "Why does {t} matter in everyday life?",
    "Write a short story for children that involves {t}.",
    "What are some good questions to ask an expert on {t}?",
    "Describe {t} using an analogy.",
    "Write a limerick about {t}.",
    "What would a beginner's reading list on {t} look like?",
    "Tell me something surprising about {t}.",
    "Write a short dialogue between a teacher and a student about {t}.",
    "In one paragraph, what is {t}?",
    "What are the main arguments for and against {t}?",
    "Write a product description inspired by {t}.",
    "Explain {t} as if you were a pirate.",
    "Give me a fun fact about {t} that I can share at dinner.",
    "What careers are related to {t}?",
    "Write a short motivational speech that mentions {t}.",
    "Create a simple lesson plan about {t} for a 30-minute class.",
    "What are three questions students often ask about {t}, with short answers?",
]

CODE_TASKS = [
    "reverse a string", "check whether a number is prime", "merge two sorted lists",
    "count the words in a sentence", "find the largest element in a list", "compute the factorial of n",
    "compute the n-th Fibonacci number", "remove duplicates from a list", "check if a string is a palindrome",
    "convert Celsius to Fahrenheit", "sort a list of dictionaries by a key", "read a CSV file and sum a column",
    "flatten a nested list", "compute the average of a list of numbers", "count vowels in a string",
    "find the greatest common divisor of two numbers", "check if two strings are anagrams",
    "capitalize the first letter of every word", "find the second largest number in a list",
    "compute the sum of the digits of an integer", "implement binary search", "implement bubble sort",
    "rotate a list by k positions", "validate an email address", "count the frequency of each character",
    "transpose a matrix", "generate all subsets of a set", "check if a year is a leap year",
    "convert a decimal number to binary", "find the intersection of two lists", "implement a stack",
    "implement a queue using two stacks", "parse a date string", "find the longest word in a sentence",
    "compute the dot product of two vectors", "chunk a list into groups of n",
    "merge two dictionaries", "find the mode of a list", "compute the median of a list",
    "remove punctuation from a string", "convert a string to title case", "count lines in a file",
    "find all prime numbers below n", "check if a list is sorted", "swap two variables",
    "compute the power set of a list", "find the longest common prefix of strings",
    "reverse the words in a sentence", "compute the area of a circle", "generate a random password",
]

CODE_TEMPLATES = [
    "Write a Python function to {t}.",
    "How do I {t} in JavaScript?",
    "Show me how to {t} in Python, with a short explanation.",
    "Write a Python function to {t}, and include a docstring and an example.",
    "What is the simplest way to {t} in Python?",
    "Write a C function to {t}.",
    "Explain step by step how to {t} in code.",
    "Write a unit test for a Python function that should {t}.",
]

ADVICE = [
    "improve my sleep", "save money on groceries", "learn a new language", "stay focused while studying",
    "start running", "keep my houseplants alive", "prepare for a job interview", "reduce stress at work",
    "write a good resume", "organize my closet", "make new friends in a new city", "cook rice perfectly",
    "start a vegetable garden", "drink more water", "read more books", "get better at chess",
    "plan a budget trip", "learn to play the guitar", "keep a journal", "wake up earlier",
    "be more productive in the morning", "negotiate a salary", "give constructive feedback",
    "take better photos with my phone", "learn to code", "prepare for an exam", "clean my kitchen faster",
    "train my dog to sit", "reduce screen time", "host a dinner party",
    "pay off debt faster", "learn to swim as an adult", "improve my handwriting", "meditate every day",
    "become a better listener", "write a short story", "start a podcast", "learn to draw",
    "eat more vegetables", "travel with less luggage", "stop procrastinating", "improve my posture",
    "memorize vocabulary", "make my home more energy efficient", "keep my inbox organized",
    "plan a wedding on a budget", "teach my child to read", "prepare for a marathon",
    "get better sleep while travelling", "build a habit of exercising",
]

ADVICE_TEMPLATES = [
    "How can I {t}?",
    "Give me five tips to {t}.",
    "What is a simple plan to {t} in one month?",
    "What mistakes should I avoid when I try to {t}?",
    "I want to {t}. Where should I start?",
]

PAIRS = [
    ("a virus", "a bacterium"), ("weather", "climate"), ("a list", "a tuple in Python"),
    ("TCP", "UDP"), ("a crocodile", "an alligator"), ("speed", "velocity"), ("RAM", "storage"),
    ("a simile", "a metaphor"), ("baking soda", "baking powder"), ("an asteroid", "a comet"),
    ("stocks", "bonds"), ("a lake", "a pond"), ("mitosis", "meiosis"), ("HTTP", "HTTPS"),
    ("a democracy", "a republic"), ("affect", "effect"), ("a frog", "a toad"), ("latitude", "longitude"),
    ("a hurricane", "a tornado"), ("Python", "JavaScript"), ("a novel", "a novella"),
    ("an emulsion", "a suspension"), ("git merge", "git rebase"), ("a violin", "a viola"),
    ("a CPU", "a GPU"), ("an ocean", "a sea"), ("empathy", "sympathy"), ("a loan", "a grant"),
    ("a rabbit", "a hare"), ("a planet", "a star"), ("a recession", "a depression"), ("SQL", "NoSQL"),
    ("a hypothesis", "a theory"), ("an alligator", "a caiman"), ("coffee", "tea"), ("a museum", "a gallery"),
    ("renting", "buying a home"), ("cardio", "strength training"), ("a poem", "a song"), ("jam", "jelly"),
]

PAIR_TEMPLATES = [
    "What is the difference between {a} and {b}?",
    "Compare {a} and {b} in a short table.",
    "Explain {a} versus {b} in two sentences.",
]

SENTENCES = [
    "me and him goes to the store yesterday and buyed some apple",
    "The meeting have been moved to next week because the manager are sick.",
    "I think that maybe we should possibly consider the option of perhaps leaving earlier.",
    "Our product is very good and many people like it a lot.",
    "The results of the experiment was not what we expected them to be.",
    "Can you send me the file asap, I need it for the thing tomorrow.",
    "The cat sat on the mat and looked at the bird outside the window.",
    "Due to the fact that it was raining, the game was cancelled.",
    "She don't like coffee but she drink tea every morning.",
    "Technology is changing how people work, learn and communicate with each other.",
    "We regret to inform you that your application was not successful this time.",
    "The new park downtown has a playground, a pond and lots of shady trees.",
    "Its important to backup you're files regularly.",
    "The quick brown fox jumps over the lazy dog.",
    "Learning to cook is a useful skill that saves money and is fun.",
    "The train was late so I missed the beginning of the concert.",
    "Their going to they're house after the game, but there car is broken.",
    "Please find attached the document which I have attached to this email.",
    "Our team worked really hard and did a really good job on the really big project.",
    "The weather today is sunny with a light breeze from the west.",
    "He said he will call me tomorrow but he never calls when he says.",
    "Reading before bed helps many people relax and fall asleep faster.",
    "Customers who buys two items gets a third item for free.",
    "The museum will be closed on Monday for maintenance.",
]

SENTENCE_TEMPLATES = [
    "Fix the grammar in this sentence: \"{s}\"",
    "Rewrite this sentence to sound more formal: \"{s}\"",
    "Rewrite this sentence to be shorter and clearer: \"{s}\"",
    "Translate this sentence into French: \"{s}\"",
    "Translate this sentence into Spanish: \"{s}\"",
    "Paraphrase the following sentence in three different ways: \"{s}\"",
]

EMAILS = [
    ("my landlord", "a broken heater"), ("my team", "a deadline change"), ("a customer", "a delayed order"),
    ("my professor", "an extension for an assignment"), ("a colleague", "thanks for their help"),
    ("my neighbour", "a noisy party next weekend"), ("a hiring manager", "a follow-up after an interview"),
    ("my manager", "taking a day off"), ("a client", "a price increase"), ("a friend", "a birthday invitation"),
    ("the city council", "a broken street light"), ("a supplier", "a wrong delivery"),
    ("my teacher", "missing a class"), ("a new colleague", "a welcome lunch"), ("my bank", "a wrong charge"),
    ("a restaurant", "a great dinner"), ("my gym", "cancelling a membership"), ("a recruiter", "a job offer"),
    ("my team", "a project launch"), ("a landlord", "renewing a lease"),
]

EMAIL_TEMPLATES = [
    "Write a short email to {who} about {what}.",
    "Write a polite but firm message to {who} about {what}.",
]

NAMES = ["Anna", "Ben", "Carla", "David", "Elif", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kofi", "Lena"]
ITEMS = ["apples", "pencils", "books", "cookies", "stickers", "marbles", "tickets", "oranges"]


def _math_prompts(rng: random.Random, n: int) -> Iterator[tuple[str, str]]:
    """Arithmetic word problems with seeded numbers."""
    kinds = [
        lambda: f"{rng.choice(NAMES)} has {rng.randint(5, 60)} {rng.choice(ITEMS)} and gives away "
                f"{rng.randint(1, 5)}. Then they buy {rng.randint(2, 30)} more. How many do they have now?",
        lambda: f"A train travels {rng.randint(60, 600)} km in {rng.randint(2, 8)} hours. "
                "What is its average speed?",
        lambda: f"What is {rng.randint(11, 99)} multiplied by {rng.randint(11, 99)}? Show your work.",
        lambda: f"A shirt costs ${rng.randint(15, 80)} and is on sale for {rng.choice([10, 15, 20, 25, 30, 40, 50])}% "
                "off. What is the sale price?",
        lambda: f"Solve for x: {rng.randint(2, 9)}x + {rng.randint(1, 20)} = {rng.randint(21, 99)}.",
        lambda: f"A rectangle is {rng.randint(3, 20)} cm wide and {rng.randint(3, 20)} cm long. "
                "What are its area and perimeter?",
        lambda: f"If you save ${rng.randint(5, 50)} every week, how much will you have after "
                f"{rng.randint(4, 52)} weeks?",
        lambda: f"What is {rng.randint(2, 9)}/{rng.randint(10, 20)} as a decimal, rounded to two places?",
        lambda: f"A recipe needs {rng.randint(2, 5)} eggs for {rng.randint(2, 6)} people. "
                f"How many eggs are needed for {rng.randint(7, 20)} people?",
        lambda: f"Is {rng.randint(100, 999)} divisible by {rng.choice([3, 4, 6, 7, 9, 11])}? Explain.",
    ]
    for i in range(n):
        yield "math", kinds[i % len(kinds)]()


@dataclass(frozen=True)
class Prompt:
    id: int
    category: str
    messages: tuple[dict[str, str], ...]
    heldout: bool

    def to_json(self) -> str:
        return json.dumps(
            {"id": self.id, "category": self.category, "heldout": self.heldout,
             "messages": list(self.messages)},
            ensure_ascii=False,
        )


def build() -> list[Prompt]:
    """Every prompt, shuffled with a fixed seed; every HELDOUT_EVERY-th is held out."""
    rng = random.Random(SEED)
    items: list[tuple[str, str]] = []
    items += [("explain", t.format(t=topic)) for t in TOPIC_TEMPLATES for topic in TOPICS]
    items += [("code", t.format(t=task)) for t in CODE_TEMPLATES for task in CODE_TASKS]
    items += [("advice", t.format(t=task)) for t in ADVICE_TEMPLATES for task in ADVICE]
    items += [("compare", t.format(a=a, b=b)) for t in PAIR_TEMPLATES for a, b in PAIRS]
    items += [("rewrite", t.format(s=s)) for t in SENTENCE_TEMPLATES for s in SENTENCES]
    items += [("email", t.format(who=w, what=x)) for t in EMAIL_TEMPLATES for w, x in EMAILS]
    items += list(_math_prompts(rng, 500))
    items = list(dict.fromkeys(items))  # seeded numbers can repeat a word problem
    rng.shuffle(items)
    return [
        Prompt(i, category, ({"role": "user", "content": text},), i % HELDOUT_EVERY == HELDOUT_EVERY - 1)
        for i, (category, text) in enumerate(items)
    ]


def write(path: Path = PROMPTS_FILE) -> int:
    prompts = build()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(p.to_json() + "\n" for p in prompts), encoding="utf-8")
    return len(prompts)


def load(path: Path = PROMPTS_FILE) -> list[Prompt]:
    """Read a prompt file (the shipped one by default; any JSONL with `messages` works)."""
    prompts = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
        if not line.strip():
            continue
        row = json.loads(line)
        prompts.append(Prompt(
            int(row.get("id", i)), str(row.get("category", "")), tuple(row["messages"]),
            bool(row.get("heldout", i % HELDOUT_EVERY == HELDOUT_EVERY - 1)),
        ))
    return prompts


def split(prompts: list[Prompt], n_train: int | None, n_heldout: int | None) -> tuple[list[Prompt], list[Prompt]]:
    """The first n_train training prompts and the first n_heldout held-out prompts (None = all)."""
    train = [p for p in prompts if not p.heldout]
    heldout = [p for p in prompts if p.heldout]
    return train[:n_train], heldout[:n_heldout]


if __name__ == "__main__":
    print(f"wrote {write()} prompts to {PROMPTS_FILE}")
