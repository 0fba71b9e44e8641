"""The fixed prompts every bench run uses, as chat messages."""

from __future__ import annotations

SHORT = [{"role": "user", "content": "What is the capital of France?"}]

CHINESE_CODE = [
    {
        "role": "user",
        "content": "用Python写一个函数，读取一个CSV文件，按第二列分组并计算每组第三列的平均值。"
        "请解释代码中用到的每个库。",
    }
]

MULTI_TURN = [
    {"role": "system", "content": "You are a concise assistant for an office help desk."},
    {"role": "user", "content": "My laptop will not connect to the office Wi-Fi."},
    {
        "role": "assistant",
        "content": "Is Wi-Fi switched on, and do you see the office network in the list?",
    },
    {"role": "user", "content": "Yes, I see it, but it says the password is wrong."},
    {
        "role": "assistant",
        "content": "The password changed on Monday. Did you get the new one from IT by email?",
    },
    {"role": "user", "content": "I did not. Who should I ask, and what do I need to tell them?"},
]

# The next turn of MULTI_TURN, run right after it: what prefix-cache reuse is for.
FOLLOW_UP = MULTI_TURN + [
    {"role": "assistant", "content": "Ask the IT desk on the second floor; give your user name."},
    {"role": "user", "content": "Thanks. And the printer on my floor is offline too."},
]

PROMPTS: dict[str, list[dict]] = {
    "short": SHORT,
    "chinese_code": CHINESE_CODE,
    "multi_turn": MULTI_TURN,
    "follow_up": FOLLOW_UP,
}

# TTFT percentiles are over these; follow_up is reported on its own.
CORE = ("short", "chinese_code", "multi_turn")
