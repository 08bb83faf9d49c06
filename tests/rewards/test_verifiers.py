"""The built-in verifiers on real-looking and malformed completions."""

import pytest

from fastppo import rewards

GSM8K_ANSWER = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
    "altogether in April and May.\n#### 72"
)


@pytest.mark.parametrize(
    "completion,expected",
    [
        ("She sold 48 in April and 24 in May, so 48 + 24 = 72.\n#### 72", 1.0),
        ("48 + 24 = 72 clips. The answer is 72.", 1.0),  # no marker: the last number
        ("In total: $72.00", 1.0),  # a currency sign and trailing zeros
        ("#### 72.0", 1.0),
        ("The answer is 72 clips, not 48.", 0.0),  # the last number is not the answer
        ("#### 72\nWait, let me recount: 73", 1.0),  # the marker wins over a later number
        ("#### seventy-two", 0.0),  # a marker with no number after it
        ("So 72.\n#### seventy-two", 0.0),  # ... and then not the prose's last number either
        ("#### 72\n#### 72\n#### ", 1.0),  # cut off after a repeated marker: the last one with a number
        ("#### The answer is 72 apples", 1.0),
        ("I don't know.", 0.0),  # no number at all
        ("", 0.0),
        ("#### -72", 0.0),
        ("72 72 72 #### 27", 0.0),
    ],
)
def test_gsm8k_reads_the_final_number_and_compares_it_exactly(completion, expected):
    assert rewards.gsm8k_reward(["q"], [completion], answer=[GSM8K_ANSWER]) == [expected]


@pytest.mark.parametrize(
    "completion,answer,expected",
    [
        ("The total is 1,234 dollars.", "1234", 1.0),  # thousands separators
        ("#### 1,234,567", "#### 1234567", 1.0),
        ("1,2,3 so 3", "123", 0.0),  # a list of numbers is not 123
        ("-5 degrees", "-5", 1.0),
        ("0.5", ".5", 1.0),
        ("about 3.14159", "3.14", 0.0),
    ],
)
def test_gsm8k_normalises_separators_and_signs(completion, answer, expected):
    assert rewards.gsm8k_reward(["q"], [completion], answer=[answer]) == [expected]


def test_gsm8k_refuses_a_reference_with_no_number():
    with pytest.raises(ValueError, match="the answer 'none' holds no number"):
        rewards.gsm8k_reward(["q"], ["1"], answer=["none"])
    with pytest.raises(ValueError, match="needs each row's 'answer' to be a string or a number, got NoneType"):
        rewards.gsm8k_reward(["q"], ["1"], answer=[None])


@pytest.mark.parametrize(
    "text,expected",
    [
        (r"so the answer is $\boxed{\frac{1}{2}}$.", r"\frac{1}{2}"),
        (r"\boxed{1} then \boxed{2}", "2"),  # the last one
        (r"\boxed{a{b}c}", "a{b}c"),  # nested braces
        (r"\boxed 5$", "5"),
        (r"\fbox{7}", "7"),
        (r"\boxed{unclosed", None),
        ("no box here", None),
        (r"\boxed", None),
    ],
)
def test_boxed_extraction_matches_braces(text, expected):
    assert rewards.extract_boxed(text) == expected


@pytest.mark.parametrize(
    "completion,answer,expected",
    [
        (r"Thus $\boxed{42}$.", "42", 1.0),
        (r"Thus $\boxed{42.0}$.", r"The answer is $\boxed{42}$", 1.0),  # the reference's own box, as numbers
        (r"\boxed{ \frac{1}{2} }", r"\frac{1}{2}", 1.0),  # whitespace aside
        (r"\boxed{0.5}", r"\frac{1}{2}", 0.0),  # symbolic equivalence is the math reward's
        ("42", "42", 0.0),  # no box
        (r"\boxed{42", "42", 0.0),  # never closed
    ],
)
def test_boxed_compares_the_last_box(completion, answer, expected):
    assert rewards.boxed_reward(["q"], [completion], answer=[answer]) == [expected]


def test_math_verifies_equivalent_answers():
    pytest.importorskip("math_verify")
    completions = [
        r"The probability is $\boxed{\frac{1}{2}}$.",
        r"So $x = 0.5$, i.e. \boxed{0.5}",
        r"\boxed{\frac{2}{3}}",
        "I cannot solve this.",
        r"\boxed{",
    ]
    scores = rewards.math_reward(["q"] * 5, completions, answer=[r"\frac{1}{2}"] * 5)
    assert scores == [1.0, 1.0, 0.0, 0.0, 0.0]
    solution = r"Half of the cases work, so the answer is $\boxed{\dfrac12}$."  # MATH's reference format
    assert rewards.math_reward(["q"], [r"\boxed{1/2}"], answer=[solution]) == [1.0]


def test_math_without_the_library_says_how_to_install_it(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_math_verify(name, *args, **kwargs):
        if name == "math_verify":
            raise ImportError("No module named 'math_verify'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_math_verify)
    with pytest.raises(ImportError, match=r"pip install 'fastppo\[math\]'"):
        rewards.math_reward(["q"], ["1"], answer=["1"])


@pytest.mark.parametrize(
    "completion,expected",
    [
        ("<think>48 + 24 = 72</think>\n<answer>72</answer>", 1.0),
        ("  <think>\nmulti\nline\n</think><answer>72</answer>\n", 1.0),
        ("<think>no answer tag</think>", 0.0),
        ("<answer>72</answer><think>wrong order</think>", 0.0),
        ("preamble <think>x</think><answer>1</answer>", 0.0),  # the whole completion must match
        ("", 0.0),
    ],
)
def test_format_matches_the_whole_completion(completion, expected):
    assert rewards.format_reward()(["q"], [completion]) == [expected]


def test_format_takes_any_pattern_and_refuses_a_broken_one():
    boxed_last = rewards.format_reward(r".*\\boxed\{[^}]+\}\.?")
    assert boxed_last(["q"] * 2, [r"so \boxed{3}.", r"\boxed{} no"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="is not a regular expression"):
        rewards.format_reward("(unclosed")
