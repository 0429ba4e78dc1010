"""A reward in the keyword style of verifiers' rubrics: relayrl fills each parameter by its name (`completion`
the text, `answer` the row's answer string, here its `solution` column by data.answer_field)."""


def correct(completion, answer, **kwargs):
    return float(completion.strip() == answer)
