"""Environment libraries as relayrl agents (issue 34, deliverable 4): each module's make_agent(ref, params) returns
an agent function of the agent contract (relayrl.serve.agents), which runs the library's own episode against the
episode's OpenAI-compatible base URL, so the endpoint records every token.

    verifiers_env.make_agent(ENV_ID, params)          rollout.agent: verifiers:ENV_ID   (a verifiers v1 environment)
    gym_env.make_agent("pkg.module:Class", params)    rollout.agent: gym:pkg.module:Class   (a Gymnasium-style text env)

Nothing here is imported by relayrl's core; verifiers and gymnasium are imported when an agent is made (the
`agents` extra).
"""
