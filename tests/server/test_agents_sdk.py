"""The openai Agents SDK (`agents`) runs an agent with a function tool against the live app, with
both of its OpenAI model classes: the Responses API and Chat Completions. The FakeEngine's script
calls the tool when the prompt offers it and holds no tool result yet, then answers."""

from __future__ import annotations

import openai
import pytest
from aiohttp.test_utils import TestServer

from engine.types import EngineRequest
from server.app import STATE_KEY, create_app
from server.config import ServerConfig
from server.registry import REGISTRY_KEY
from tests.server.fake_engine import FakeEngineFactory, FakeTokenizer, fake_spec

agents = pytest.importorskip("agents")


def script(request: EngineRequest) -> list[str]:
    prompt = FakeTokenizer().decode(request.prompt_token_ids)
    if "<|tools|>" in prompt and "<|tool|>" not in prompt:
        return ['<tool>get_weather|{"city": "Paris"}</tool>']
    return ["It is sunny", " in Paris."]


@pytest.fixture
async def client(tmp_path):
    factory = FakeEngineFactory(script=script, max_seq_len=4096)
    app = create_app(ServerConfig(models=[fake_spec("fake", tmp_path)], checkpoint_roots=[tmp_path]), factory)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    await app[STATE_KEY].startup_task
    async with app[REGISTRY_KEY].lease("fake"):
        pass
    sdk = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="none", max_retries=0)
    yield sdk, factory
    await sdk.close()
    await server.close()


@pytest.mark.parametrize("model_class", ["OpenAIResponsesModel", "OpenAIChatCompletionsModel"])
async def test_agent_with_a_function_tool(client, model_class):
    sdk, factory = client
    agents.set_tracing_disabled(True)
    seen: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        seen.append(city)
        return f"sunny in {city}"

    model = getattr(agents, model_class)(model="fake", openai_client=sdk)
    agent = agents.Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather], model=model)
    result = await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=3)
    assert seen == ["Paris"] and result.final_output == "It is sunny in Paris."
    dialog, tools = factory.engines["fake"].chat_format.dialogs[-1]
    assert [t.name for t in tools] == ["get_weather"]
    assert [m.role for m in dialog] == ["system", "user", "assistant", "tool"]
    assert dialog[-1].content == "sunny in Paris" and dialog[-1].tool_call_id == dialog[-2].tool_calls[0].call_id
