"""JSON schemas the tests ask the real model to follow, shared by the files that send them."""

NAME = {"type": "string", "maxLength": 40}
QUANTITY = {"type": "integer", "minimum": 1, "maximum": 1000}
PERSON = {
    "type": "object",
    "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 130}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
TICKET = {
    "type": "object",
    "properties": {
        "category": {"enum": ["hardware", "software", "network", "other"]},
        "urgent": {"type": "boolean"},
        "summary": {"type": "string", "maxLength": 80},
    },
    "required": ["category", "urgent", "summary"],
    "additionalProperties": False,
}
CITY = {
    "type": "object",
    "properties": {
        "city": NAME,
        "country": NAME,
        "population_millions": {"type": "number", "minimum": 0, "maximum": 100},
        "landmarks": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3},
    },
    "required": ["city", "country", "landmarks"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "customer": {
            "type": "object",
            "properties": {"name": NAME, "email": {"type": "string", "maxLength": 60}},
            "required": ["name"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "maxItems": 4,
            "items": {
                "type": "object",
                # Bounded, as every field here: max_tokens then covers the longest answer
                # the schema allows, and "stop" is owed whatever the model picks (unbounded,
                # the embedded model wrote 10000... to the end of 1,024 tokens).
                "properties": {"product": NAME, "quantity": QUANTITY},
                "required": ["product", "quantity"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["customer", "items"],
    "additionalProperties": False,
}
YES_NO = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}

# The functions of the tool-calling tests (issue 27), in /chat's flat shape; OpenAI's wraps
# each as {"type": "function", "function": ...}, and inference's Function(**WEATHER) reads it.
WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": NAME},
        "required": ["city"],
        "additionalProperties": False,
    },
}
TIME = {
    "name": "get_time",
    "description": "Get the current time in a time zone",
    "parameters": {
        "type": "object",
        "properties": {"zone": {"enum": ["UTC", "CET", "JST"]}},
        "required": ["zone"],
        "additionalProperties": False,
    },
}
