"""Seeded synthetic users for the recall benchmark (recall.py): each user says
personal facts over several multi-turn conversations, and questions with gold
answers ask about them.

Facts are sentences of the user's turns, in the user's words ("My sister is
called Maya."). Kinds of facts: names (relatives, friends, pets), numbers
(ages, counts, apartment numbers), places (cities), preferences (colours,
food, sports, ...) and facts that refer to an earlier fact through a pronoun
("She lives in Porto." right after the sister's name, in the same turn or the
next one), whose question names the referent ("In which city does my sister
live?"): such a question's gold facts are the referent and the referring fact.

Everything is plain Python and depends only on the seed: generate(seed,
users) gives the same corpus on every machine. Tokenization is left to the
caller (recall.py), which tokenizes every piece on its own and concatenates,
so that a fact has the same token ids in its conversation and in a prompt.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

FEMALE_NAMES = ["Maya", "Priya", "Ingrid", "Leila", "Nadia", "Amara", "Sofia", "Yuki", "Elena", "Clara", "Freya",
                "Greta", "Zara", "Hana", "Rosa", "Ines", "Lena", "Vera", "Mila", "Alma", "Nora", "Petra", "Lucia",
                "Dalia", "Selma"]
MALE_NAMES = ["Jonas", "Tomas", "Rafael", "Oskar", "Felix", "Hugo", "Mateo", "Dmitri", "Arjun", "Omar", "Luca",
              "Viktor", "Emil", "Kofi", "Marek", "Tariq", "Anton", "Bruno", "Sven", "Idris", "Casper", "Henrik",
              "Pavel", "Ravi"]
PET_NAMES = ["Biscuit", "Pepper", "Rocket", "Mochi", "Ziggy", "Noodle", "Clover", "Waffles", "Pixel", "Juniper",
             "Tofu", "Marble", "Comet", "Pickle", "Sprout", "Nugget"]
CITIES = [
    "Lisbon", "Oslo", "Kyoto", "Porto", "Krakow", "Toronto", "Nairobi", "Seville", "Tallinn", "Melbourne",
    "Valencia", "Bergen", "Lyon", "Antwerp", "Dublin", "Zagreb", "Montreal", "Helsinki", "Bologna", "Edinburgh",
    "Cusco", "Hanoi", "Riga", "Malaga", "Geneva", "Hamburg", "Vilnius", "Glasgow", "Osaka", "Lima",
]
JOBS = ["nurse", "pilot", "architect", "chef", "plumber", "teacher", "dentist", "librarian", "carpenter",
        "pharmacist", "journalist", "firefighter", "electrician", "baker", "lawyer", "surgeon"]
HOBBIES = ["pottery", "chess", "climbing", "knitting", "surfing", "gardening", "painting", "fencing", "birdwatching",
           "rowing", "juggling", "archery"]

# (key, noun, subject pronoun, object pronoun / possessive, names pool)
RELATIONS = [
    ("sister", "sister", "She", "her", FEMALE_NAMES), ("brother", "brother", "He", "his", MALE_NAMES),
    ("mother", "mother", "She", "her", FEMALE_NAMES), ("father", "father", "He", "his", MALE_NAMES),
    ("best_friend", "best friend", "She", "her", FEMALE_NAMES), ("boss", "boss", "He", "his", MALE_NAMES),
    ("neighbor", "neighbor", "She", "her", FEMALE_NAMES), ("cousin", "cousin", "He", "his", MALE_NAMES),
    ("aunt", "aunt", "She", "her", FEMALE_NAMES), ("uncle", "uncle", "He", "his", MALE_NAMES),
    ("son", "son", "He", "his", MALE_NAMES), ("daughter", "daughter", "She", "her", FEMALE_NAMES),
    ("grandmother", "grandmother", "She", "her", FEMALE_NAMES), ("roommate", "roommate", "He", "his", MALE_NAMES),
    ("coach", "coach", "She", "her", FEMALE_NAMES), ("dog", "dog", "He", "his", PET_NAMES),
    ("cat", "cat", "She", "her", PET_NAMES),
]

# facts about the user: (key, kind, sentence, question, value pool)
ATTRIBUTES = [
    ("born", "place", "I was born in {v}.", "In which city was I born?", CITIES),
    ("live", "place", "I live in {v} these days.", "In which city do I live?", CITIES),
    ("holiday", "place", "Next summer I am going on holiday to {v}.", "Where am I going on holiday next summer?",
     CITIES),
    ("studied", "place", "I went to university in {v}.", "In which city did I go to university?", CITIES),
    ("color", "preference", "My favourite colour is {v}.", "What is my favourite colour?",
     ["teal", "orange", "purple", "yellow", "crimson", "green", "navy", "beige", "turquoise", "maroon"]),
    ("food", "preference", "My favourite food is {v}.", "What is my favourite food?",
     ["sushi", "lasagna", "tacos", "ramen", "paella", "curry", "dumplings", "risotto", "falafel", "pancakes"]),
    ("drink", "preference", "I always drink {v} in the morning.", "What do I drink in the morning?",
     ["espresso", "green tea", "orange juice", "cocoa", "lemonade", "chai", "milk", "kombucha"]),
    ("sport", "preference", "The sport I love most is {v}.", "Which sport do I love most?",
     ["tennis", "rugby", "volleyball", "badminton", "cricket", "hockey", "basketball", "golf", "squash"]),
    ("instrument", "preference", "I play the {v}.", "Which instrument do I play?",
     ["cello", "violin", "trumpet", "piano", "banjo", "flute", "harp", "saxophone", "drums", "ukulele"]),
    ("car", "preference", "I drive a {v}.", "What car do I drive?",
     ["Volvo", "Toyota", "Fiat", "Subaru", "Skoda", "Mazda", "Renault", "Kia", "Honda", "Peugeot"]),
    ("language", "preference", "At work I mostly write {v}.", "Which programming language do I mostly write at work?",
     ["Rust", "Python", "Haskell", "Kotlin", "Fortran", "Ruby", "Scala", "Elixir", "Go", "Julia"]),
    ("flower", "preference", "My favourite flowers are {v}.", "What are my favourite flowers?",
     ["tulips", "daisies", "orchids", "lilies", "peonies", "sunflowers", "roses", "irises"]),
    ("season", "preference", "My favourite season is {v}.", "What is my favourite season?",
     ["spring", "summer", "autumn", "winter"]),
    ("hobby", "preference", "On weekends I do {v}.", "What do I do on weekends?", HOBBIES),
    ("apartment", "number", "My apartment number is {v}.", "What is my apartment number?",
     [str(n) for n in range(101, 990, 37)]),
    ("age", "number", "I am {v} years old.", "How old am I?", [str(n) for n in range(19, 78, 3)]),
    ("plants", "number", "I have {v} plants on my balcony.", "How many plants do I have on my balcony?",
     [str(n) for n in range(3, 40, 2)]),
    ("commute", "number", "My commute takes {v} minutes.", "How many minutes does my commute take?",
     [str(n) for n in range(12, 95, 7)]),
    ("books", "number", "I read {v} books last year.", "How many books did I read last year?",
     [str(n) for n in range(4, 60, 5)]),
    ("shoe", "number", "My shoe size is {v}.", "What is my shoe size?", [str(n) for n in range(36, 48)]),
    ("employer", "name", "I work at a company called {v}.", "What is the name of the company I work at?",
     ["Brightline", "Northwind", "Kestrel Labs", "Bluefin", "Ironbark", "Solace", "Quillon", "Tidewater",
      "Larkspur", "Copperleaf"]),
    ("allergy", "preference", "I am allergic to {v}.", "What am I allergic to?",
     ["peanuts", "shellfish", "pollen", "cats", "penicillin", "strawberries", "latex", "wasps"]),
]

# facts that refer to a relation through its pronoun: (key, kind, sentence, question, pool)
REFERRING = [
    ("city", "place", "{P} lives in {v}.", "In which city does my {n} live?", CITIES),
    ("age", "number", "{P} is {v} years old.", "How old is my {n}?", [str(n) for n in range(2, 90, 3)]),
    ("job", "preference", "{P} works as {a} {v}.", "What does my {n} work as?", JOBS),
    ("hobby", "preference", "{P} is really into {v}.", "What is my {n} really into?", HOBBIES),
]

FILLER_USER = [
    "I had a long day today.", "Can you help me plan my week?", "It has been raining all morning.",
    "I am trying to be more organised.", "Sorry, I got distracted for a moment.", "Let me think about that.",
    "That reminds me of something.", "Anyway, back to what I was saying.", "I just made some coffee.",
    "By the way, thanks for the tips yesterday.", "I want to remember this for later.",
    "This week is going to be busy.",
]
FILLER_ASSISTANT = [
    "Thanks for telling me, I will keep that in mind.", "That sounds lovely. Is there anything I can help with?",
    "Got it. What would you like to do next?", "Good to know! Let me know if you need anything.",
    "I see. Would you like some suggestions?", "Noted. How is the rest of your day going?",
    "That is interesting, tell me more if you like.", "Sure, I can help with that whenever you are ready.",
]


@dataclass
class Fact:
    index: int            # the user's facts in order of saying: 0, 1, ...
    text: str             # the sentence as the user said it (no leading space)
    kind: str             # name, number, place, preference
    refers_to: Optional[int] = None  # index of the fact whose pronoun this one uses


@dataclass
class Question:
    qid: int
    user: int
    text: str
    answer: str
    gold: List[int]       # fact indices the answer needs (a referent first, then the fact)
    kind: str
    referring: bool


@dataclass
class Conversation:
    # turns: (role, [sentences]) where a sentence is a str (filler) or an int (a fact index)
    turns: List[Tuple[str, list]] = field(default_factory=list)


@dataclass
class User:
    uid: int
    facts: List[Fact]
    conversations: List[Conversation]
    questions: List[Question]


def _user(rng: random.Random, uid: int, qid0: int, min_facts: int) -> User:
    facts: List[Fact] = []
    questions: List[Question] = []
    blocks = []  # each block: fact indices said together (a name and what refers to it)
    rels = rng.sample(RELATIONS, 16)
    used = {}  # pool id -> values taken by this user (values unique per user and pool)

    def take(pool):
        taken = used.setdefault(id(pool), set())
        v = rng.choice([x for x in pool if x not in taken])
        taken.add(v)
        return v

    def add(text, kind):
        facts.append(Fact(len(facts), text, kind))
        return facts[-1]

    def ask(text, answer, gold, kind, referring):
        questions.append(Question(qid0 + len(questions), uid, text, answer, gold, kind, referring))

    for key, noun, P, _, pool in rels:
        name = take(pool)
        f = add("My %s is called %s." % (noun, name), "name")
        ask("What is my %s's name?" % noun, name, [f.index], "name", False)
        block = [f.index]
        for rkey, kind, sent, q, rpool in rng.sample(REFERRING, rng.choice([1, 1, 2])):
            if key in ("dog", "cat") and rkey in ("job", "hobby"):
                continue
            v = rng.choice(rpool) if rkey == "age" else take(rpool)
            g = add(sent.format(P=P, v=v, a="an" if v[0] in "aeiou" else "a"), kind)
            g.refers_to = f.index
            ask(q.format(n=noun), v, [f.index, g.index], kind, True)
            block.append(g.index)
        blocks.append(block)
    attrs = rng.sample(ATTRIBUTES, len(ATTRIBUTES))
    for key, kind, sent, q, pool in attrs:
        if len(facts) >= min_facts + 2:
            break
        v = take(pool)
        f = add(sent.format(v=v), kind)
        ask(q, v, [f.index], kind, False)
        blocks.append([f.index])
    if len(facts) < min_facts:
        raise RuntimeError("user %d has %d facts (< %d)" % (uid, len(facts), min_facts))
    # Blocks in a random order, renumbered so that fact indices follow the
    # order of saying; then cut into conversations of user/assistant turns.
    rng.shuffle(blocks)
    order = [i for b in blocks for i in b]
    renum = {old: new for new, old in enumerate(order)}
    facts = [facts[old] for old in order]
    for f in facts:
        f.index = renum[f.index]
        if f.refers_to is not None:
            f.refers_to = renum[f.refers_to]
    for q in questions:
        q.gold = [renum[g] for g in q.gold]
    convs: List[Conversation] = []
    n_conv = rng.randint(3, 5)
    cuts = sorted(rng.sample(range(1, len(blocks)), n_conv - 1))
    spans = [blocks[a:b] for a, b in zip([0] + cuts, cuts + [len(blocks)])]
    for span in spans:
        c = Conversation()
        pending = [[renum[i] for i in b] for b in span]
        while pending:
            sents = []
            if rng.random() < 0.5:
                sents.append(rng.choice(FILLER_USER))
            b = pending.pop(0)
            if len(b) > 1 and rng.random() < 0.35:
                # the referring facts come in the next user turn, after an assistant reply
                sents.extend(b[:1])
                pending.insert(0, b[1:])
            else:
                sents.extend(b)
            if rng.random() < 0.3:
                sents.append(rng.choice(FILLER_USER))
            c.turns.append(("user", sents))
            c.turns.append(("assistant", [rng.choice(FILLER_ASSISTANT)]))
        convs.append(c)
    rng.shuffle(questions)
    return User(uid, facts, convs, questions)


def generate(seed: int = 0, users: int = 50, min_facts: int = 51) -> List[User]:
    """users users (uid 1..users), each with >= min_facts facts and one
    question per fact that has a gold answer (names, numbers, places,
    preferences; referring facts ask through the referent)."""
    rng = random.Random(seed)
    out, qid = [], 0
    for uid in range(1, users + 1):
        u = _user(random.Random(rng.getrandbits(64)), uid, qid, min_facts)
        qid += len(u.questions)
        out.append(u)
    return out


def questions_of(users: List[User], per_user: Optional[int] = None) -> List[Question]:
    """The questions, per_user of each user (all if None), in a fixed order."""
    qs = []
    for u in users:
        qs.extend(u.questions if per_user is None else u.questions[:per_user])
    return qs


if __name__ == "__main__":
    us = generate(0, 3)
    u = us[0]
    for c in u.conversations[:1]:
        for role, sents in c.turns:
            print(role + ":", " ".join(s if isinstance(s, str) else "[%d] %s" % (s, u.facts[s].text) for s in sents))
    for q in u.questions[:8]:
        print(q.text, "->", q.answer, q.gold, [u.facts[g].text for g in q.gold])
    print(len(u.facts), "facts,", len(u.questions), "questions")
