// deskchat's chat page: streams answers from /v1/chat/completions with fetch and keeps the
// conversation in the page. Model output is untrusted: it only ever reaches the page as text
// nodes (textContent), never as HTML; fenced code blocks and `inline code` are the only
// Markdown rendered, and they are text too.
"use strict";

const API = "/v1/chat/completions";
const TOKENIZE = "/v1/tokenize"; // the count the answer's prompt_tokens will report
const KEY_STORE = "deskchat.apiKey";
const DEFAULT_RETRY_S = 5;

const $ = (id) => document.getElementById(id);
const log = $("log");
const scroller = document.querySelector("main");
const prompt = $("prompt");
const composer = $("composer");
const sendButton = $("send");
const stopButton = $("stop");
const statusLine = $("status");
const modelLine = $("model");
const keyDialog = $("key-dialog");
const keyInput = $("key");

let history = []; // the whole conversation, {role, content}: what is sent is fitted from it
let running = null; // the AbortController of the answer in progress
let notice = null; // the line saying older messages were left out, when they were

class Failure extends Error {}

function setStatus(text) {
  statusLine.textContent = text;
}

function showModel(name) {
  modelLine.textContent = name ? `Model: ${name}` : "";
}

// Text with ``` fences and `inline code`, built from text nodes only.
function render(element, text) {
  element.replaceChildren();
  const parts = text.split("```");
  parts.forEach((part, i) => {
    if (i % 2 === 1) {
      const newline = part.indexOf("\n");
      const code = document.createElement("code");
      code.textContent = (newline >= 0 ? part.slice(newline + 1) : "").replace(/\n$/, "");
      const pre = document.createElement("pre");
      pre.append(code);
      element.append(pre);
      return;
    }
    // the line breaks around a code block are the block's own
    if (i > 0) part = part.replace(/^\n/, "");
    if (i < parts.length - 1) part = part.replace(/\n$/, "");
    for (const piece of part.split(/(`[^`\n]+`)/)) {
      if (piece.length > 2 && piece.startsWith("`") && piece.endsWith("`")) {
        const code = document.createElement("code");
        code.textContent = piece.slice(1, -1);
        element.append(code);
      } else if (piece) {
        element.append(document.createTextNode(piece));
      }
    }
  });
}

function addMessage(role, text) {
  const item = document.createElement("article");
  item.className = `msg ${role}`;
  const who = document.createElement("h2");
  who.className = "who";
  who.textContent = role === "user" ? "You" : "Assistant";
  const body = document.createElement("div");
  body.className = "body";
  const meta = document.createElement("p");
  meta.className = "meta";
  item.append(who, body, meta);
  log.append(item);
  render(body, text);
  scroller.scrollTop = scroller.scrollHeight;
  return { item, body, meta, text };
}

// A thinking model's thought: collapsed above its answer (a click opens it), as text.
function showThought(answer, text) {
  if (!answer.thought) {
    const box = document.createElement("details");
    box.className = "thought";
    const summary = document.createElement("summary");
    summary.textContent = "Thought";
    answer.thought = document.createElement("div");
    box.append(summary, answer.thought);
    answer.item.insertBefore(box, answer.body);
  }
  answer.thought.textContent = text;
}

function setRunning(controller) {
  running = controller;
  sendButton.disabled = controller !== null;
  stopButton.disabled = controller === null;
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return body.error.message;
  } catch (_) {
    // not JSON: fall through
  }
  return `HTTP ${response.status}`;
}

function retryAfter(response) {
  const seconds = parseInt(response.headers.get("Retry-After") || "", 10);
  return Number.isFinite(seconds) && seconds > 0 ? seconds : DEFAULT_RETRY_S;
}

// "busy, retrying in N s", counting down; Stop ends the wait.
function countdown(seconds, signal) {
  return new Promise((resolve, reject) => {
    let left = seconds;
    setStatus(`busy, retrying in ${left} s`);
    const timer = setInterval(() => {
      left -= 1;
      if (left > 0) {
        setStatus(`busy, retrying in ${left} s`);
        return;
      }
      clearInterval(timer);
      setStatus("");
      resolve();
    }, 1000);
    signal.addEventListener(
      "abort",
      () => {
        clearInterval(timer);
        setStatus("");
        reject(new DOMException("stopped", "AbortError"));
      },
      { once: true },
    );
  });
}

// The key dialog: resolves to the key typed, or null when cancelled.
function askForKey(message) {
  $("key-message").textContent = message;
  keyInput.value = "";
  return new Promise((resolve) => {
    const done = (key) => {
      keyDialog.removeEventListener("close", onClose);
      $("key-form").onsubmit = null;
      $("key-cancel").onclick = null;
      if (keyDialog.open) keyDialog.close();
      resolve(key);
    };
    const onClose = () => done(null);
    $("key-form").onsubmit = (event) => {
      event.preventDefault();
      done(keyInput.value.trim() || null);
    };
    $("key-cancel").onclick = () => done(null);
    keyDialog.addEventListener("close", onClose);
    keyDialog.showModal();
    keyInput.focus();
  });
}

// Reads the SSE stream into the answer; returns the final chunk's details.
async function readStream(response, answer) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  const result = { model: null, finish: null, timings: null, usage: null };
  let thought = "";
  let pending = false;
  const paint = () => {
    pending = false;
    render(answer.body, answer.text);
    scroller.scrollTop = scroller.scrollHeight;
  };
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut = buffer.indexOf("\n\n");
    while (cut >= 0) {
      const frame = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      cut = buffer.indexOf("\n\n");
      const data = frame
        .split("\n")
        .filter((line) => line.startsWith("data: "))
        .map((line) => line.slice(6))
        .join("\n");
      if (!data || data === "[DONE]") continue;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Failure(chunk.error.message);
      if (chunk.model) result.model = chunk.model;
      if (chunk.usage) result.usage = chunk.usage;
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) continue;
      if (choice.delta && choice.delta.reasoning_content) {
        thought += choice.delta.reasoning_content;
        showThought(answer, thought);
      }
      if (choice.delta && choice.delta.content) {
        answer.text += choice.delta.content;
        if (!pending) {
          pending = true;
          requestAnimationFrame(paint);
        }
      }
      if (choice.finish_reason) {
        result.finish = choice.finish_reason;
        result.timings = chunk.timings || null;
      }
    }
  }
  paint();
  if (!result.finish) throw new Failure("the answer ended early");
  return result;
}

function post(path, body, headers, signal) {
  return fetch(path, { method: "POST", headers, body: JSON.stringify(body), signal });
}

// The messages to send: the whole conversation when the server takes it, else without its
// oldest exchanges (a system message and the newest question always stay), as many as the
// server's /v1/tokenize says must go. Returns null when even the newest question alone is
// too long (the server's 413 then says so).
async function fitted(conversation, whole, headers, signal) {
  if (whole.fits) return { messages: conversation, left: 0 };
  const system = conversation.filter((m) => m.role === "system");
  const rest = conversation.filter((m) => m.role !== "system");
  const starts = rest.flatMap((m, i) => (m.role === "user" && i > 0 ? [i] : []));
  const keep = (start) => [...system, ...rest.slice(start)];
  // Dropping more never adds tokens: find the fewest exchanges to leave out.
  let low = 0;
  let high = starts.length - 1; // the newest question alone
  let best = null;
  while (low <= high) {
    const middle = (low + high) >> 1;
    const response = await post(TOKENIZE, { model: "deskchat", messages: keep(starts[middle]) },
      headers, signal);
    if (!response.ok) break;
    if ((await response.json()).fits) {
      best = starts[middle];
      high = middle - 1;
    } else {
      low = middle + 1;
    }
  }
  return best === null ? null : { messages: keep(best), left: best };
}

// Says in the conversation, above the newest question, how much the model no longer sees.
function showLeftOut(left, question) {
  if (!left) return;
  if (!notice) {
    notice = document.createElement("p");
    notice.className = "notice";
    notice.setAttribute("role", "status");
  }
  const messages = left === 1 ? "message was" : "messages were";
  notice.textContent = `The ${left} oldest ${messages} left out of what the model sees: the ` +
    "conversation is longer than this server takes. Start a new chat for a fresh topic.";
  log.insertBefore(notice, question.item);
}

// One answer: retries after a 503 (Retry-After) and after a new key for a 401.
async function ask(conversation, question, answer, signal) {
  for (;;) {
    const headers = { "Content-Type": "application/json" };
    const key = localStorage.getItem(KEY_STORE);
    if (key) headers.Authorization = `Bearer ${key}`;
    let messages = conversation;
    let response = await post(TOKENIZE, { model: "deskchat", messages }, headers, signal);
    if (response.ok) {
      const fit = await fitted(conversation, await response.json(), headers, signal);
      if (fit) {
        messages = fit.messages;
        showLeftOut(fit.left, question);
      }
      response = await post(API, {
        model: "deskchat",
        messages,
        stream: true,
        stream_options: { include_usage: true },
      }, headers, signal);
    }
    if (response.status === 401) {
      const why = await errorMessage(response);
      const fresh = await askForKey(
        key ? "The saved API key was not accepted; enter another." : "This server needs an API key.",
      );
      if (!fresh) throw new Failure(why);
      localStorage.setItem(KEY_STORE, fresh);
      continue;
    }
    if (response.status === 503) {
      const wait = retryAfter(response);
      await errorMessage(response);
      await countdown(wait, signal);
      continue;
    }
    if (!response.ok) throw new Failure(await errorMessage(response));
    setStatus("");
    return readStream(response, answer);
  }
}

function describe(result) {
  const parts = [];
  if (result.model) parts.push(result.model);
  if (result.timings && result.timings.tokens_per_second !== undefined) {
    parts.push(`${result.timings.tokens_per_second.toFixed(1)} tokens/s`);
  }
  if (result.usage) parts.push(`${result.usage.completion_tokens} tokens`);
  if (result.finish === "length") parts.push("cut at the length limit");
  return parts.join(" · ");
}

async function send(text) {
  const conversation = history; // "New chat" starts another; this answer belongs to this one
  conversation.push({ role: "user", content: text });
  const question = addMessage("user", text);
  const answer = addMessage("assistant", "");
  answer.item.setAttribute("aria-busy", "true");
  const controller = new AbortController();
  setRunning(controller);
  try {
    const result = await ask(conversation, question, answer, controller.signal);
    conversation.push({ role: "assistant", content: answer.text });
    if (result.model) showModel(result.model);
    answer.meta.textContent = describe(result);
  } catch (error) {
    render(answer.body, answer.text);
    if (answer.text) {
      conversation.push({ role: "assistant", content: answer.text }); // what was shown stays
    } else {
      conversation.pop(); // nothing came back: the question is not part of the conversation
      if (!prompt.value) prompt.value = text;
    }
    if (error.name === "AbortError") {
      answer.meta.textContent = "stopped";
    } else {
      answer.meta.textContent = `error: ${error.message}`;
      answer.meta.classList.add("error");
    }
  } finally {
    answer.item.removeAttribute("aria-busy");
    setStatus("");
    setRunning(null);
    prompt.focus();
  }
}

composer.addEventListener("submit", (event) => {
  event.preventDefault();
  const text = prompt.value.trim();
  if (!text || running) return;
  prompt.value = "";
  send(text);
});

prompt.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    composer.requestSubmit();
  }
});

stopButton.addEventListener("click", () => {
  if (running) running.abort(); // the server sees the connection close and cancels the job
});

$("new-chat").addEventListener("click", () => {
  if (running) running.abort();
  history = [];
  notice = null;
  log.replaceChildren();
  prompt.focus();
});

// The model's name before the first answer: /health is open and names it.
fetch("/health")
  .then((response) => response.json())
  .then((body) => showModel(body.model))
  .catch(() => {});
prompt.focus();
