"""The shipped distillation prompt set: templated, self-instruct, multi-turn and quoted-input routes.

Routes (all deterministic, seeded, checked in as distill/prompt_sets/distill_prompts.jsonl):
- templated: templates x topics (explanations, creative writing, code,
  arithmetic word problems, rewriting, advice, comparisons, emails), the
  original set; every 20th of its seeded shuffle is held out (the "templated
  held-out set"), with the same ids and order as before;
- self-instruct: requests written by the target itself ("Write one question a
  user might ask an AI assistant about X"), cleaned and de-duplicated;
- multi-turn: a self-instruct request, the target's own answer to it, then a
  follow-up ("Make it shorter", "Give an example", ...);
- quoted input: rewrite / summarize / code tasks that quote their input, from a
  pool of passages and code snippets in this module and the target's answers.
The target's outputs come from a separate model step (`python -m
distill prompts`, distill.selfinstruct), checked in as
distill/prompt_sets/distill_generated.jsonl, so building the set needs no model.
The new routes are interleaved with the templated training prompts (half of
every prefix of the file until they run out), so a data stage cut short by its
time budget still sees them in proportion.

Regenerate with `python -m distill.heldout` (the test suite checks
that the file matches this module).
"""
from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "prompt_sets"
PROMPTS_FILE = DATA_DIR / "distill_prompts.jsonl"
GENERATED_FILE = DATA_DIR / "distill_generated.jsonl"
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


# --- Self-instruct: requests written by the target (raw outputs in GENERATED_FILE) ---------------------

# (instruction, assistant prefill): the prefill ends in an opening quote, so the target writes the
# request itself and closes the quote (a 135M model asked plainly mostly answers "I'm ready to help").
QUESTION_INSTRUCTIONS = [
    ("Write one question a user might ask an AI assistant about {t}.",
     'Here is a question a user might ask about {t}:\n\n"'),
    ("Write one practical question a beginner could ask about {t}.",
     'Here is a practical beginner question about {t}:\n\n"'),
]
SELF_INSTRUCT_SUBJECTS = (TOPICS + [f"how to {a}" for a in ADVICE]
                          + [f"how to {c} in Python" for c in CODE_TASKS])
ANSWERED_QUESTIONS = 128  # self-instruct requests the target answers (multi-turn history, quoted passages)


def question_requests() -> list[tuple[int, str, str]]:
    """(instruction index, subject, instruction text) for every self-instruct request, in a fixed order."""
    return [(i, t, text.format(t=t)) for i, (text, _) in enumerate(QUESTION_INSTRUCTIONS)
            for t in SELF_INSTRUCT_SUBJECTS]


def question_prefill(instruction: int, subject: str) -> str:
    """The assistant-turn text the target continues from when writing a request."""
    return QUESTION_INSTRUCTIONS[instruction][1].format(t=subject)


def clean_question(raw: str) -> str | None:
    """The request inside the target's quoted output, or None when it is not a usable request.

    Usable: closed by a quote (or a single line ending in '?'), 4 to 40 words,
    and not the target talking about itself ("I'm here to help ...").
    """
    text = raw.strip()
    if '"' in text:
        text = text[:text.index('"')].strip()
    elif "\n" in text or not text.endswith("?"):
        return None
    words = text.split()
    if not 4 <= len(words) <= 40 or len(text) < 15:
        return None
    if text.lower().startswith(("i'm here", "i am here", "i'm ready", "here is", "here's", "the task is")):
        return None
    return text


def load_generated(path: Path = GENERATED_FILE) -> list[dict]:
    """The raw rows of the self-instruct step (empty when it has not run)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def self_instruct_questions(rows: list[dict]) -> list[str]:
    """The cleaned requests, de-duplicated (case-insensitively), in generation order."""
    seen: dict[str, str] = {}
    for row in rows:
        if row["kind"] == "question" and (q := clean_question(row["raw"])) is not None:
            seen.setdefault(q.casefold(), q)
    return list(seen.values())


def questions_to_answer(rows: list[dict]) -> list[str]:
    """The seeded selection of cleaned requests that the target answers."""
    questions = self_instruct_questions(rows)
    return random.Random(SEED + 1).sample(questions, min(ANSWERED_QUESTIONS, len(questions)))


def trim_answer(raw: str, finished: bool) -> str | None:
    """A complete answer: as written if it ended, else cut after its last full sentence (None if none)."""
    text = raw.strip()
    if not finished:
        cut = max(text.rfind(end) for end in (". ", ".\n", "! ", "? ", ":\n"))
        text = text[:cut + 1].strip() if cut > 0 else ""
    return text if len(text.split()) >= 8 else None


def answered(rows: list[dict]) -> list[tuple[str, str]]:
    """(request, the target's trimmed answer) for every answered request with a usable answer."""
    out = []
    for row in rows:
        if row["kind"] == "answer" and (a := trim_answer(row["raw"], row["finished"])) is not None:
            out.append((row["question"], a))
    return out


# --- Multi-turn and quoted-input routes ----------------------------------------------------------------

FOLLOW_UPS = [
    "Make it shorter.", "Give an example.", "Now in bullet points.", "Can you explain that more simply?",
    "Summarize your answer in one sentence.", "Why is that?", "Can you say more about the first point?",
    "Rewrite that for a ten-year-old.", "What is a common mistake here?", "Turn that into a list of steps.",
    "Translate your answer into French.", "Make it more formal.", "Thanks! Can you add one more tip?",
    "Write that as a short poem.",
]
FOLLOW_UPS_PER_ANSWER = 4
QUOTES_PER_ANSWER = 2  # passage templates each target answer is quoted in

PASSAGES = [
    "Residents packed the town hall last week to debate the new bike lanes. Some said the lanes made "
    "their commute safer, while shop owners worried about losing parking spaces. In the end the mayor "
    "proposed a six-month trial with a survey before any final decision.",
    "Honey never spoils if it is stored properly. Archaeologists have found pots of honey in ancient "
    "Egyptian tombs that are thousands of years old and still edible. Its low moisture and high acidity "
    "make it a poor home for bacteria.",
    "Our quarterly sales grew by twelve percent, mainly because of strong demand for the new product line. "
    "However, shipping costs also rose, so profit margins stayed about the same. Next quarter we plan to "
    "renegotiate contracts with our delivery partners.",
    "hey so i wanted to let u know that the party is moved to saturday because alot of people cant come "
    "on friday. bring snacks if u can and tell the others ok",
    "Gardening on a balcony is easier than many people think. Herbs such as basil and mint grow well in "
    "small pots, tomatoes need a sunny spot and a large container, and most plants prefer being watered "
    "deeply a few times a week rather than a little every day.",
    "The library will extend its opening hours during the exam period. From May 1 to May 20, the reading "
    "rooms will stay open until midnight, and extra study desks will be available on the second floor.",
    "Volcanoes form where molten rock from deep inside the Earth reaches the surface. Some erupt "
    "explosively, throwing ash high into the air, while others release slow rivers of lava. Many "
    "volcanoes sit along the edges of tectonic plates.",
    "I bought this blender last month and it has been great. It crushes ice easily and is simple to clean, "
    "but it is quite loud and the lid sometimes leaks when the jug is full.",
    "The first bicycles appeared in the early nineteenth century and had no pedals; riders pushed them "
    "along with their feet. Pedals, chains and air-filled tyres came later and turned the bicycle into "
    "one of the most efficient ways to travel.",
    "Dear team, thanks for all your hard work this year. The project launched on time, and customer "
    "feedback has been very positive. Please remember to submit your holiday requests by the end of the "
    "month so we can plan the schedule.",
    "Sleep is when the brain stores memories and the body repairs itself. Adults usually need seven to "
    "nine hours a night. Screens before bed, caffeine and irregular schedules are common reasons people "
    "sleep badly.",
    "The recipe is simple: mix flour, water, salt and yeast, let the dough rise for two hours, shape it, "
    "let it rise again, and bake it in a hot oven for about forty minutes until the crust is golden.",
    "Password managers store all your passwords in an encrypted vault, so you only have to remember one "
    "master password. They can also generate long random passwords, which are much harder to guess than "
    "the ones people usually choose.",
    "the meeting was long and honestly not very useful we talked about the budget for an hour but nobody "
    "made a decision and then we ran out of time before the last two topics",
    "Coral reefs cover less than one percent of the ocean floor but support about a quarter of all marine "
    "species. Warmer water causes corals to expel the algae that feed them, a process called bleaching.",
    "Remote work gives employees more flexibility and saves commuting time. On the other hand, some people "
    "feel isolated, and teams can find it harder to share ideas informally.",
]

PASSAGE_TEMPLATES = [
    "Rewrite this paragraph more formally:\n\n{p}",
    "Summarize:\n\n{p}",
    "Summarize this text in one sentence:\n\n{p}",
    "What is the main point of this passage?\n\n{p}",
    "Turn this text into a bulleted list:\n\n{p}",
    "Simplify this paragraph so a child can understand it:\n\n{p}",
    "Suggest a title for this text:\n\n{p}",
    "Proofread the following text and fix any errors:\n\n{p}",
    "Write three questions that this text answers:\n\n{p}",
    "Make this text more concise:\n\n{p}",
]

CODE_SNIPPETS = [
    "def greet(name):\n    return 'Hello, ' + name + '!'",
    "def total(prices):\n    s = 0\n    for p in prices:\n        s += p\n    return s",
    "def is_even(n):\n    return n % 2 == 0",
    "def word_count(text):\n    counts = {}\n    for w in text.split():\n        counts[w] = counts.get(w, 0) + 1\n"
    "    return counts",
    "def clamp(x, low, high):\n    return max(low, min(x, high))",
    "def read_lines(path):\n    with open(path) as f:\n        return [line.strip() for line in f]",
    "def initials(name):\n    return ''.join(part[0].upper() for part in name.split())",
    "def mean(xs):\n    return sum(xs) / len(xs)",
    "def find(items, target):\n    for i, x in enumerate(items):\n        if x == target:\n            return i\n"
    "    return -1",
    "def squares(n):\n    return [i * i for i in range(n)]",
    "def merge(a, b):\n    out = dict(a)\n    out.update(b)\n    return out",
    "def fizzbuzz(n):\n    for i in range(1, n + 1):\n        if i % 15 == 0:\n            print('FizzBuzz')\n"
    "        elif i % 3 == 0:\n            print('Fizz')\n        elif i % 5 == 0:\n            print('Buzz')\n"
    "        else:\n            print(i)",
    "def unique(xs):\n    seen = set()\n    out = []\n    for x in xs:\n        if x not in seen:\n"
    "            seen.add(x)\n            out.append(x)\n    return out",
]

BUGGY_SNIPPETS = [
    "def percent(part, whole):\n    return part / whole * 10",
    "def last(items):\n    return items[len(items)]",
    "def is_adult(age):\n    if age > 18:\n        return True\n    return False",
    "def count_down(n):\n    while n > 0:\n        print(n)",
    "def maximum(xs):\n    best = 0\n    for x in xs:\n        if x > best:\n            best = x\n    return best",
    "def reverse(s):\n    out = ''\n    for c in s:\n        out = out + c\n    return out",
    "def factorial(n):\n    result = 0\n    for i in range(1, n + 1):\n        result *= i\n    return result",
    "def contains(items, x):\n    for item in items:\n        if item == x:\n            return True\n        else:\n"
    "            return False",
]

CODE_BLOCK = "\n\n```python\n{c}\n```"
CODE_SNIPPET_TEMPLATES = [
    "Add type hints to this function:", "Explain what this code does:", "Write a docstring for this function:",
    "Rewrite this function to be more readable:", "Write unit tests for this function:",
    "Convert this Python function to JavaScript:", "What is the time complexity of this function?",
]
BUGGY_SNIPPET_TEMPLATES = [
    "Fix the bug in:", "This function has a bug. Find it and fix it:", "Why does this code give the wrong result?",
]

Messages = tuple[dict[str, str], ...]


def _user(text: str) -> Messages:
    return ({"role": "user", "content": text},)


def message_key(messages: Messages) -> str:
    """A hashable identity of a conversation (dicts are not hashable)."""
    return json.dumps(list(messages), sort_keys=True, ensure_ascii=False)


def self_instruct_items(questions: list[str]) -> list[tuple[str, Messages]]:
    """One single-turn prompt per cleaned self-instruct request."""
    return [("self-instruct", _user(q)) for q in questions]


def multi_turn_items(pairs: list[tuple[str, str]], rng: random.Random) -> list[tuple[str, Messages]]:
    """Request, the target's answer, then FOLLOW_UPS_PER_ANSWER different seeded follow-ups."""
    items = []
    for question, answer in pairs:
        for follow_up in rng.sample(FOLLOW_UPS, FOLLOW_UPS_PER_ANSWER):
            items.append(("multi-turn", (*_user(question), {"role": "assistant", "content": answer},
                                         *_user(follow_up))))
    return items


def quoted_items(pairs: list[tuple[str, str]], rng: random.Random) -> list[tuple[str, Messages]]:
    """Rewrite/summarize tasks quoting a passage (the pool, or a target answer), and code tasks quoting code."""
    items = [("quoted-text", _user(t.format(p=p))) for t in PASSAGE_TEMPLATES for p in PASSAGES]
    items += [("quoted-text", _user(t.format(p=answer))) for _, answer in pairs
              for t in rng.sample(PASSAGE_TEMPLATES, QUOTES_PER_ANSWER)]
    items += [("quoted-code", _user(t + CODE_BLOCK.format(c=c))) for t in CODE_SNIPPET_TEMPLATES
              for c in CODE_SNIPPETS]
    items += [("quoted-code", _user(t + CODE_BLOCK.format(c=c))) for t in BUGGY_SNIPPET_TEMPLATES
              for c in BUGGY_SNIPPETS]
    return items


def generated_items(rows: list[dict]) -> list[tuple[str, Messages]]:
    """Every prompt of the new routes, de-duplicated, in a seeded order."""
    rng = random.Random(SEED + 2)
    pairs = answered(rows)
    items = self_instruct_items(self_instruct_questions(rows)) + multi_turn_items(pairs, rng)
    items += quoted_items(pairs, rng)
    unique = list({message_key(m): (c, m) for c, m in items}.values())
    rng.shuffle(unique)
    return unique


def interleave(first: list, second: list) -> list:
    """Alternate the two lists (each in its own order) while both last, then the rest of the longer one."""
    out = []
    for a, b in zip(first, second):
        out += [a, b]
    n = min(len(first), len(second))
    return out + first[n:] + second[n:]


def templated() -> list[Prompt]:
    """The templated route: every prompt, shuffled with a fixed seed; every HELDOUT_EVERY-th is held out.

    Unchanged from the first prompt set (same ids, order and held-out flags), so
    its held-out prompts stay comparable across drafts.
    """
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
        Prompt(i, category, _user(text), i % HELDOUT_EVERY == HELDOUT_EVERY - 1)
        for i, (category, text) in enumerate(items)
    ]


def build(generated: Path = GENERATED_FILE) -> list[Prompt]:
    """The templated prompts interleaved with the new routes (training only, ids after the templated ones)."""
    base = templated()
    taken = {message_key(p.messages) for p in base}
    new = [(c, m) for c, m in generated_items(load_generated(generated)) if message_key(m) not in taken]
    extra = [Prompt(len(base) + i, c, m, False) for i, (c, m) in enumerate(new)]
    return interleave(base, extra)


def write_jsonl(prompts: list[Prompt], path: Path) -> int:
    """One JSON row per prompt; returns how many."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(p.to_json() + "\n" for p in prompts), encoding="utf-8")
    return len(prompts)


def write(path: Path = PROMPTS_FILE) -> int:
    return write_jsonl(build(), path)


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
