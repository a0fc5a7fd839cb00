//! `petal chat`: an interactive chat in the terminal. Lines from stdin are user messages; replies stream to stdout.
//! The conversation keeps one inference session across turns (see [`petal_client::Conversation`]).
use crate::args::SamplingArgs;
use crate::backend::ModelArgs;
use clap::Args;
use petal_client::Conversation;
use std::io::Write;
use tokio::io::AsyncBufReadExt;

#[derive(Args, Debug)]
pub struct ChatArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// System message (default: an empty one, so the template adds no persona of its own).
    #[arg(long)]
    pub system: Option<String>,
    /// Positions the conversation's session reserves (more are taken when a turn needs them), at most the
    /// model's context.
    #[arg(long, default_value_t = petal_client::conversation::DEFAULT_WINDOW)]
    pub context: usize,
    /// Print no statistics line after each reply.
    #[arg(long)]
    pub quiet: bool,
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

const HELP: &str = "commands: /reset clears the conversation, /exit (or end of input) quits";

pub async fn run(args: ChatArgs) -> anyhow::Result<()> {
    let config = args.sampling.config()?;
    anyhow::ensure!(args.context > 0, "--context must be at least 1");
    let loaded = args.model.load().await?;
    let mut conversation =
        Conversation::new(&loaded.generator, &loaded.tokenizer, args.system.clone())?
            .with_window(args.context);
    eprintln!("chatting with {}; {HELP}", args.model.model);
    let mut lines = tokio::io::BufReader::new(tokio::io::stdin()).lines();
    let mut failed_turns = 0usize;
    loop {
        eprint!("> ");
        let _ = std::io::stderr().flush();
        let Some(line) = lines.next_line().await? else {
            eprintln!();
            break;
        };
        let line = line.trim();
        match line {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                conversation.reset().await;
                eprintln!("(conversation cleared)");
                continue;
            }
            "/help" => {
                eprintln!("{HELP}");
                continue;
            }
            _ => {}
        }
        let turn = conversation
            .send(line, &config, |piece| {
                print!("{piece}");
                let _ = std::io::stdout().flush();
            })
            .await;
        println!();
        match turn {
            Ok(turn) if !args.quiet => {
                let out = &turn.completion.output;
                eprintln!(
                    "({} new prompt tokens, {} generated, {:?}, {:.1} tokens/s; session {} at position {})",
                    turn.new_prompt_tokens,
                    turn.completion.sampled.len(),
                    out.finish_reason,
                    out.tokens_per_second,
                    conversation.sessions_opened(),
                    conversation.position()
                );
            }
            Ok(_) => {}
            Err(e) => {
                failed_turns += 1;
                eprintln!("error: {e}");
            }
        }
    }
    conversation.close().await;
    if let Some(client) = &loaded.client {
        client.shutdown().await;
    }
    anyhow::ensure!(
        failed_turns == 0,
        "{failed_turns} turn(s) failed (see the errors above)"
    );
    Ok(())
}
