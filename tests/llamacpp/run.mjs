// Greedy tokens and next-token log-probabilities from llama.cpp (node-llama-cpp's prebuilt CPU binary) for a GGUF
// model, optionally with a LoRA adapter GGUF. Driven by tests/llamacpp/__init__.py:
//   node run.mjs REQUEST.json RESULT.json
// REQUEST: {module, model, lora|null, threads, context_size, top,
//           prompts: [{tokens, max_new_tokens, score}]}
// RESULT:  {llama_cpp, results: [{greedy, logprobs}]}: greedy = up to max_new_tokens tokens (an end-of-generation
// token included, then stop); logprobs[i] = the `top` most likely [token, log p] after tokens + score[:i],
// i = 0 .. len(score).
import {readFileSync, writeFileSync} from "node:fs";
import {pathToFileURL} from "node:url";

const [requestPath, resultPath] = process.argv.slice(2);
const request = JSON.parse(readFileSync(requestPath, "utf8"));
const {getLlama, LlamaLogLevel} = await import(pathToFileURL(request.module).href);

// build "never": the prebuilt binary or nothing (a source build would need cmake and minutes)
const llama = await getLlama({gpu: false, build: "never", maxThreads: request.threads, logLevel: LlamaLogLevel.error});
const model = await llama.loadModel({modelPath: request.model, gpuLayers: 0});
const context = await model.createContext({
    contextSize: request.context_size, batchSize: request.context_size, sequences: 1, threads: request.threads,
    lora: request.lora ? {adapters: [{filePath: request.lora, scale: 1}]} : undefined,
});
const sequence = context.getSequence();
const greedy = {temperature: 0};  // llama.cpp's greedy sampler alone: probabilities are the softmax of the logits

function top(probabilities, k) {
    const out = [];
    for (const [token, p] of probabilities) {  // sorted, most likely first
        if (out.length === k) break;
        out.push([token, Math.log(p)]);
    }
    return out;
}

async function logprobs(tokens, score, k) {
    await sequence.clearHistory();
    const input = [...tokens, ...score];
    const first = tokens.length - 1;  // the last prompt token predicts score[0]
    const output = await sequence.controlledEvaluate(input.map((token, i) => i < first ? token
        : [token, {generateNext: {probabilities: true, options: greedy}}]));
    return output.slice(first).map((item) => top(item.next.probabilities, k));
}

async function generate(tokens, maxNewTokens) {
    await sequence.clearHistory();
    const out = [];
    if (maxNewTokens <= 0) return out;
    for await (const token of sequence.evaluate(tokens, {...greedy, yieldEogToken: true})) {
        out.push(token);
        if (out.length >= maxNewTokens || model.isEogToken(token)) break;
    }
    return out;
}

const results = [];
for (const prompt of request.prompts) {
    results.push({greedy: await generate(prompt.tokens, prompt.max_new_tokens),
                  logprobs: await logprobs(prompt.tokens, prompt.score, request.top)});
}
writeFileSync(resultPath, JSON.stringify({llama_cpp: llama.llamaCppRelease, results}));
await context.dispose();
await model.dispose();
await llama.dispose();
