// One tab-autocomplete request the way Continue.dev sends it, from a generated config.yaml,
// through Continue's own HTTP layer (@continuedev/fetch: fetchwithRequestOptions + streamSse,
// which honour requestOptions.caBundlePath as a file path or a data: URI).
//
// What Continue's core does with the config, reproduced here (continuedev/continue):
//  - core/autocomplete/templating: the autocomplete promptTemplate is rendered with Handlebars;
//    stop words = defaultCompletionOptions.stop, then Continue's own stops appended
//    (getStopTokens.ts: "\n\n", "\r\n\r\n", "/src/", "#- coding: utf-8", "```"; mergeJson concatenates);
//  - core/autocomplete/CompletionProvider.ts: temperature 0.01 unless set; OpenAI provider on
//    the legacy /completions endpoint;
//  - core/llm/llms/OpenAI.ts: stop sliced to maxStopWords; body {model, max_tokens, temperature,
//    stop, prompt, stream: true, ...requestOptions.extraBodyProperties}; apiBase gets a trailing "/".
//
// Usage: node continue_fim.mjs CONFIG.yaml PREFIX SUFFIX [--no-ca]
// Prints one JSON line: {ok, text, finishReason, usage, chunks, request} or {ok: false, error, code}.
import { readFileSync } from "node:fs";

import { parseConfigYaml } from "@continuedev/config-yaml";
import { fetchwithRequestOptions, streamSse } from "@continuedev/fetch";
import Handlebars from "handlebars";

const CONTINUE_STOPS = ["\n\n", "\r\n\r\n", "/src/", "#- coding: utf-8", "```"];

const [file, prefix, suffix, ...flags] = process.argv.slice(2);
const config = parseConfigYaml(readFileSync(file, "utf8"));
const model = (config.models ?? []).find((m) => (m.roles ?? []).includes("autocomplete"));
if (!model) {
  console.log(JSON.stringify({ ok: false, error: "no model with the autocomplete role" }));
  process.exit(2);
}
const opts = model.defaultCompletionOptions ?? {};
const requestOptions = { ...(model.requestOptions ?? {}) };
if (flags.includes("--no-ca")) delete requestOptions.caBundlePath;

const prompt = Handlebars.compile(model.promptTemplates.autocomplete)({
  prefix, suffix, filename: "example.py", reponame: "example", language: "Python",
});
const stops = [...(opts.stop ?? []), ...CONTINUE_STOPS];
const body = {
  model: model.model,
  max_tokens: opts.maxTokens,
  temperature: opts.temperature ?? 0.01,
  stop: model.maxStopWords !== undefined ? stops.slice(0, model.maxStopWords) : stops,
  prompt,
  stream: true,
  ...(requestOptions.extraBodyProperties ?? {}),
};
const apiBase = model.apiBase.endsWith("/") ? model.apiBase : `${model.apiBase}/`;
const url = new URL("completions", apiBase);
const request = { url: url.toString(), stop: body.stop, max_tokens: body.max_tokens, prompt };

try {
  const resp = await fetchwithRequestOptions(url, {
    method: "POST",
    headers: { "Content-Type": "application/json", Authorization: `Bearer ${model.apiKey}`, "api-key": model.apiKey },
    body: JSON.stringify(body),
  }, requestOptions);
  if (resp.status !== 200) {
    console.log(JSON.stringify({ ok: false, status: resp.status, error: await resp.text(), request }));
    process.exit(1);
  }
  let text = "";
  let chunks = 0;
  let finishReason = null;
  let usage = null;
  for await (const value of streamSse(resp)) {
    const choice = value.choices?.[0];
    if (choice?.text) {
      text += choice.text;
      chunks += 1;
    }
    if (choice?.finish_reason) finishReason = choice.finish_reason;
    if (value.usage) usage = value.usage;
  }
  console.log(JSON.stringify({ ok: true, text, chunks, finishReason, usage, request }));
} catch (e) {
  const cause = e.cause ?? e;
  console.log(JSON.stringify({ ok: false, error: String(e.message || e), code: cause.code ?? e.code ?? null, request }));
  process.exit(1);
}
