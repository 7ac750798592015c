// Validate Continue config.yaml files with Continue's own package (@continuedev/config-yaml):
// its YAML parser and schema (parseConfigYaml), then its validator (validateConfigYaml).
// The schema silently drops keys it does not know, so a key Continue would ignore (a typo,
// an option of another version) is reported too. Prints one JSON line: [{file, ok, problems}].
// Usage: node validate_config.mjs FILE...
import { readFileSync } from "node:fs";
import { isDeepStrictEqual } from "node:util";

import { parseConfigYaml, validateConfigYaml } from "@continuedev/config-yaml";
import YAML from "yaml";

function dropped(raw, parsed, path = "") {
  if (raw === null || typeof raw !== "object") return [];
  if (parsed === null || typeof parsed !== "object") return [path || "/"];
  return Object.keys(raw).flatMap((k) =>
    k in parsed ? dropped(raw[k], parsed[k], `${path}/${k}`) : [`${path}/${k}`],
  );
}

const results = process.argv.slice(2).map((file) => {
  const text = readFileSync(file, "utf8");
  try {
    const parsed = parseConfigYaml(text);
    const problems = validateConfigYaml(parsed).map((e) => `${e.fatal ? "fatal" : "warning"}: ${e.message}`);
    const raw = YAML.parse(text);
    if (!isDeepStrictEqual(raw, parsed)) {
      problems.push(`Continue's schema ignores: ${dropped(raw, parsed).join(", ") || "(values changed)"}`);
    }
    return { file, ok: problems.length === 0, problems };
  } catch (e) {
    return { file, ok: false, problems: [String(e.message || e)] };
  }
});
console.log(JSON.stringify(results));
process.exit(results.length > 0 && results.every((r) => r.ok) ? 0 : 1);
