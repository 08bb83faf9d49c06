"""Built-in verifiers: rewards computed from a completion and the row's reference answer.

Each is a reward function as the trainer calls one, ``f(prompts, completions, answer, **fields)
-> list of floats``, 1.0 for a correct completion and 0.0 otherwise, and states the fields it
needs in ``needs``. A completion that is an episode's messages (a run with tools) is judged by
its last assistant message (the trainer checks every row has them at start-up). ``fastppo train
--reward gsm8k`` (or ``math``, ``boxed``, ``format``) names them without a module.

* ``gsm8k``: the completion's answer is the number after its last ``####`` that has one, else
  (no marker at all) its last number; the reference is the number after the row's ``####`` (GSM8K's
  format), else the row's answer itself. Thousands separators, a ``$`` and trailing zeros do not
  matter (``1,000.0`` is ``1000``); numbers compare exactly, as decimals.
* ``boxed``: the content of the completion's last ``\\boxed{...}`` (braces matched) against the
  row's answer (its own last ``\\boxed{}`` if it has one, as MATH's solutions do); equal as
  numbers, else as strings with whitespace and ``$`` removed. Symbolic equivalence is ``math``'s.
* ``math``: answers parsed and compared symbolically by Hugging Face's ``math-verify``
  (``pip install 'fastppo[math]'``): ``\\frac{1}{2}`` equals ``0.5``. ``math-verify`` times its
  parses out with signals, so it must be called from the main thread (the trainer does).
* ``format``: 1.0 when the whole completion (outer whitespace aside) matches a regular expression:
  :func:`format_reward` makes one; the built-in uses ``--format-pattern``, by default the
  ``<think>...</think><answer>...</answer>`` layout of DeepSeek-R1's training.
"""

import re
from decimal import Decimal, InvalidOperation

# A number as written in prose: an optional sign, thousands separators only in groups of three.
NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")
THINK_ANSWER = r"<think>.*?</think>\s*<answer>.*?</answer>"


def answer_text(completion) -> str:
    """The text a verifier reads: a completion as it is, or an episode's last assistant message."""
    if isinstance(completion, str):
        return completion
    said = [m.get("content") or "" for m in completion if m.get("role") == "assistant"]
    return said[-1] if said else ""


def _decimal(text: str):
    """``text`` as a Decimal (``$``, commas and spaces ignored), or None."""
    try:
        return Decimal(text.replace(",", "").replace("$", "").strip())
    except InvalidOperation:
        return None


def gsm8k_answer(text: str):
    """The final numeric answer of ``text``: the first number after the last ``####`` that has one
    (a response cut off just after a marker keeps its earlier answer), else the last number; None
    when there is none."""
    before, *marked = text.split("####")
    for segment in reversed(marked):
        found = NUMBER.search(segment)
        if found:
            return _decimal(found.group())
    numbers = [] if marked else NUMBER.findall(before)
    return _decimal(numbers[-1]) if numbers else None


def _reference(answer, name: str) -> str:
    if not isinstance(answer, (str, int, float)) or isinstance(answer, bool):
        raise ValueError(
            f"reward {name} needs each row's 'answer' to be a string or a number, got "
            f"{type(answer).__name__} {answer!r}"
        )
    return str(answer)


def gsm8k_reward(prompts, completions, answer, **_):
    """1.0 when the completion's final number equals the reference's (see the module docstring)."""
    scores = []
    for completion, reference in zip(completions, answer):
        gold = gsm8k_answer(_reference(reference, "gsm8k"))
        if gold is None:
            raise ValueError(f"reward gsm8k: the answer {reference!r} holds no number")
        given = gsm8k_answer(answer_text(completion))
        scores.append(float(given is not None and given == gold))
    return scores


gsm8k_reward.needs = ("answer",)


def extract_boxed(text: str):
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) of ``text``, nested braces
    matched, or of ``\\boxed x`` up to the next space or ``$``; None when there is none or its
    braces never close."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start:].removeprefix("\\boxed").removeprefix("\\fbox")
    if rest.startswith(" "):
        found = re.match(r" +([^\s$]+)", rest)
        return found.group(1) if found else None
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, char in enumerate(rest):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if depth == 0:
            return rest[1:i]
    return None


def _same_answer(given: str, gold: str) -> bool:
    a, b = _decimal(given), _decimal(gold)
    if a is not None and b is not None:
        return a == b
    squeeze = lambda s: re.sub(r"\s+", "", s).replace("$", "")  # noqa: E731
    return squeeze(given) == squeeze(gold)


def boxed_reward(prompts, completions, answer, **_):
    """1.0 when the completion's last boxed answer equals the reference (see the module docstring)."""
    scores = []
    for completion, reference in zip(completions, answer):
        reference = _reference(reference, "boxed")
        gold = extract_boxed(reference)
        given = extract_boxed(answer_text(completion))
        scores.append(float(given is not None and _same_answer(given, reference if gold is None else gold)))
    return scores


boxed_reward.needs = ("answer",)


def math_reward(prompts, completions, answer, **_):
    """1.0 when ``math-verify`` finds the completion's answer equivalent to the reference."""
    try:
        from math_verify import parse, verify
    except ImportError:
        raise ImportError("reward math needs the math-verify library: pip install 'fastppo[math]'") from None
    scores = []
    for completion, reference in zip(completions, answer):
        reference = _reference(reference, "math")
        # A bare answer ("1/2") is read as a formula; a solution with $...$ or \boxed{} as written.
        gold = parse(reference if ("$" in reference or "\\boxed" in reference) else f"${reference}$")
        if not gold:
            raise ValueError(f"reward math: math-verify finds no answer in the reference {reference!r}")
        scores.append(float(verify(gold, parse(answer_text(completion)))))
    return scores


math_reward.needs = ("answer",)


def format_reward(pattern: str = THINK_ANSWER):
    """A reward function: 1.0 for a completion that, outer whitespace aside, matches ``pattern``
    whole (``.`` matching newlines too)."""
    try:
        compiled = re.compile(pattern, re.DOTALL)
    except re.error as error:
        raise ValueError(f"format pattern {pattern!r} is not a regular expression ({error})") from None

    def format_match(prompts, completions, **_):
        return [float(compiled.fullmatch(answer_text(c).strip()) is not None) for c in completions]

    format_match.needs = ()
    return format_match


# name -> a reward function, or for "format" the factory of one from the pattern
BUILTIN = {"gsm8k": gsm8k_reward, "boxed": boxed_reward, "math": math_reward, "format": format_reward}
