"""The retrieval probe's text: filler of varied prose, and facts to plant in it.

The filler is generated, not copied from a book: sentences from a few dozen templates
over word lists, drawn with a seeded generator, so any length is available, no two
paragraphs are the same, and the text holds no digit and none of the facts' key words
(a fact can only be found where it was planted). The facts are of two kinds, a number
and a name, each with its question and the answer a reply must contain.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

PEOPLE = ("the old fisherman", "a young teacher", "the baker's son", "my grandmother", "the mayor",
          "a tired traveller", "the shepherd", "our neighbour", "the schoolmaster", "a wandering musician",
          "the ferryman", "the innkeeper's wife", "a quiet clerk", "the village doctor", "two sisters",
          "the carpenter", "a group of children", "the gardener", "an elderly painter", "the blacksmith")
PLACES = ("the harbour", "the market square", "the old mill", "the river bank", "the orchard",
          "the chapel on the hill", "the railway station", "the library", "the bakery", "the meadow",
          "the narrow lane behind the church", "the edge of the forest", "the town hall", "the quay",
          "the schoolyard", "the bridge", "the vegetable garden", "the stone wall", "the village green",
          "the top of the cliff")
THINGS = ("a basket of apples", "an old map", "a wooden chair", "a letter", "a loaf of bread",
          "a lantern", "a bundle of firewood", "a broken clock", "a small boat", "a jar of honey",
          "a woollen scarf", "a bag of flour", "a painted sign", "a pair of boots", "a kettle",
          "a book of poems", "a fishing net", "a pot of soup", "a bunch of flowers", "a ladder")
VERBS = ("carried", "mended", "found", "painted", "sold", "borrowed", "left", "cleaned", "wrapped",
         "forgot", "brought", "hid", "admired", "repaired", "shared")
TIMES = ("early in the morning", "after the rain", "at noon", "late in the evening", "before dawn",
         "on a windy afternoon", "in the autumn", "during the long winter", "on market day",
         "when the bells rang", "as the sun went down", "in the spring")
FEELINGS = ("calm", "restless", "cheerful", "worried", "curious", "patient", "proud", "sleepy",
            "hopeful", "thoughtful")
WEATHER = ("The wind came in from the sea", "A thin mist lay over the fields", "The sky was clear and pale",
           "Heavy clouds gathered over the hills", "The air smelled of salt and woodsmoke",
           "Rain tapped against the windows", "The light was soft and golden", "Snow covered the rooftops")
TEMPLATES = (
    "{Person} {verb} {thing} near {place} {time}.",
    "{time_cap}, {person} walked slowly to {place}.",
    "{weather}, and {person} felt {feeling}.",
    "Nobody remembered why {person} had {verb} {thing}.",
    "At {place} there was always {thing} that someone had {verb}.",
    "{Person} said that {place} looked different {time}.",
    "{weather}; {person} stood by {place} and waited.",
    "It was {person} who {verb} {thing}, or so the story goes.",
    "{Person} was {feeling} that day, and spoke little.",
    "From {place} one could see {place2} and, beyond it, the sea.",
    "{Person} and {person2} met at {place} {time}.",
    "Everyone agreed that {thing} belonged at {place}.",
    "{time_cap}, the road to {place} was quiet.",
    "{Person} often told stories about {place}.",
    "Later, {person} {verb} {thing} and took it home.",
    "{weather}, so {person} stayed near {place}.",
)


def _cap(s: str) -> str:
    return s[0].upper() + s[1:]


def sentence(rng: np.random.Generator) -> str:
    pick = lambda xs: xs[int(rng.integers(len(xs)))]
    person, person2 = pick(PEOPLE), pick(PEOPLE)
    place, place2 = pick(PLACES), pick(PLACES)
    time = pick(TIMES)
    return pick(TEMPLATES).format(person=person, Person=_cap(person), person2=person2, place=place,
                                  place2=place2, thing=pick(THINGS), verb=pick(VERBS), time=time,
                                  time_cap=_cap(time), feeling=pick(FEELINGS), weather=pick(WEATHER))


def filler(rng: np.random.Generator, n_tokens: int, count) -> list[str]:
    """Paragraphs of prose whose token count reaches n_tokens; a paragraph is 4 to 8
    sentences. `count(text)` is called once per paragraph, in order, on the paragraph as it
    sits in text that joins paragraphs with blank lines: with the blank line in front (a
    byte-level BPE splits a blank line from the words on both sides, so these counts add
    up to the joined text's)."""
    paragraphs, total = [], 0
    while total < n_tokens:
        p = " ".join(sentence(rng) for _ in range(int(rng.integers(4, 9))))
        paragraphs.append(p)
        total += count("\n\n" + p)
    return paragraphs


def sentences(paragraph: str) -> list[str]:
    """A filler paragraph's sentences: every template ends with a full stop and holds no other."""
    return re.split(r"(?<=\.) ", paragraph)


@dataclass(frozen=True)
class Fact:
    text: str  # the sentence planted in the filler
    question: str
    answer: str  # what the reply must contain (digits compared without spaces or dashes)

    def found(self, reply: str) -> bool:
        if self.answer.isdigit():
            return self.answer in re.sub(r"[\s,.\-]", "", reply)
        return self.answer.lower() in reply.lower()


COLOURS = ("blue", "red", "green", "yellow", "grey", "white", "black", "orange")
ANIMALS = ("cat", "dog", "goat", "horse", "parrot", "donkey", "owl", "rabbit")
NAMES = ("Biscuit", "Marigold", "Pepper", "Juniper", "Clementine", "Barnaby", "Tuppence", "Rosalind",
         "Humphrey", "Saffron", "Oberon", "Wilhelmina")


def fact(rng: np.random.Generator) -> Fact:
    """A number (a locker's four-digit code) or a name (an animal's), drawn at random.

    The small default model answers by restating the question ("The code of the red locker
    is 8566."), so question and fact are worded short: the answer is out within a 16-token
    reply (spaced digits, "8 5 6 6", a space token before each, ran past it), and its tokens
    come from decode steps, the ones QSA selects blocks for, not from the prompt's dense pass."""
    pick = lambda xs: xs[int(rng.integers(len(xs)))]
    if rng.integers(2) == 0:
        colour, digits = pick(COLOURS), "".join(str(int(d)) for d in rng.integers(1, 10, 4))
        return Fact(f"The code of the {colour} locker is {digits}.",
                    f"What is the code of the {colour} locker? Answer with the four digits only.", digits)
    animal, name = pick(ANIMALS), pick(NAMES)
    return Fact(f"The {animal} at the lighthouse is called {name}.",
                f"What is the {animal} at the lighthouse called? Answer with the name only.", name)
