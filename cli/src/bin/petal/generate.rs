//! `petal generate`: one prompt, through the swarm or (--local) through the whole model in this process.
use crate::args::SamplingArgs;
use crate::backend::ModelArgs;
use clap::Args;
use petal_client::Cost;
use petal_model::text::prompt::encode_prompt;
use petal_model::GenerationOutput;
use std::io::Write;

#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[arg(long)]
    pub prompt: String,
    /// Render the prompt as a user message through the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// System message for --chat (default: an empty one, so the template adds no persona of its own).
    #[arg(long)]
    pub system: Option<String>,
    /// Print one JSON object (prompt_tokens, tokens, text, tokens_per_second, ...) instead of streaming text.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

pub async fn run(args: GenerateArgs) -> anyhow::Result<()> {
    let config = args.sampling.config()?;
    let loaded = args.model.load().await?;
    let tokenizer = &loaded.tokenizer;
    let prompt = encode_prompt(tokenizer, &args.prompt, args.chat, args.system.as_deref())?;
    let stream = !args.json;
    let completion = loaded
        .generator
        .generate(tokenizer, &prompt, &config, |piece| {
            if stream && !piece.is_empty() {
                print!("{piece}");
                let _ = std::io::stdout().flush();
            }
            true
        })
        .await;
    if let Some(client) = &loaded.client {
        client.shutdown().await;
    }
    let completion = completion?;
    let route = (!loaded.generator.is_local()).then_some(&completion.cost);
    print_output(&completion.output, route, args.json)
}

/// Prints the result; `swarm` is the completion's cost when it went through the swarm (route and hops shown).
fn print_output(output: &GenerationOutput, swarm: Option<&Cost>, json: bool) -> anyhow::Result<()> {
    if json {
        let mut v = serde_json::to_value(output)?;
        if let (Some(cost), Some(obj)) = (swarm, v.as_object_mut()) {
            obj.insert("route".into(), serde_json::json!(cost.route));
            obj.insert("hops".into(), serde_json::to_value(&cost.hops)?);
            obj.insert("failovers".into(), serde_json::to_value(&cost.failovers)?);
            // Steps whose input went server to server (decode steps, unless --no-push or drawn for a check).
            let pushed = cost
                .steps
                .iter()
                .filter(|s| s.hops.len() > 1 && s.hops.iter().all(|h| h.pushed))
                .count();
            obj.insert("pushed_steps".into(), serde_json::json!(pushed));
            obj.insert(
                "verification".into(),
                serde_json::to_value(&cost.verification)?,
            );
        }
        println!("{v}");
    } else {
        println!();
        if let Some(cost) = swarm {
            let hops: Vec<String> = cost
                .route
                .iter()
                .zip(&cost.hops)
                .map(|(r, h)| format!("{r} {}", h.path))
                .collect();
            eprintln!("route: {}", hops.join(" -> "));
            let checks = &cost.verification;
            if checks.checked_steps + checks.unverifiable + checks.skipped > 0 {
                eprintln!(
                    "verified {} hop steps ({} tokens); {} mismatches; {} unverifiable (no other server), {} skipped",
                    checks.checked_steps,
                    checks.checked_tokens,
                    checks.mismatches.len(),
                    checks.unverifiable,
                    checks.skipped
                );
            }
        }
        eprintln!(
            "{} prompt tokens, {} generated ({:?}), {:.1} tokens/s, first token {:.0} ms",
            output.prompt_tokens,
            output.tokens.len(),
            output.finish_reason,
            output.tokens_per_second,
            output.first_token_ms
        );
    }
    Ok(())
}
