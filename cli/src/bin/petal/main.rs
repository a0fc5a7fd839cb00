//! `petal`: generate text locally or through a swarm, chat, serve an OpenAI-compatible API, list or monitor the
//! swarm, or run a whole local swarm as a demo.
mod api;
mod args;
mod backend;
mod chat;
mod demo;
mod generate;
mod monitor;
mod swarm;

use clap::{Parser, Subcommand};
use petal_cli::app::{self, CommonArgs};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "petal",
    version,
    about = "Run large language models over a peer-to-peer swarm"
)]
struct Cli {
    #[command(flatten)]
    common: CommonArgs,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt, through the swarm or (--local) in this process.
    Generate(generate::GenerateArgs),
    /// Show which peers serve which blocks of which models.
    Swarm(swarm::SwarmArgs),
    /// Start a bootstrap and three nodes in-process, split the default model across them and answer a prompt.
    Demo(demo::DemoArgs),
    /// Serve an OpenAI-compatible HTTP API (/v1/models, /v1/completions, /v1/chat/completions).
    Api(api::ApiArgs),
    /// Chat in the terminal: one line per message, the conversation kept in one session.
    Chat(chat::ChatArgs),
    /// Serve a page showing the swarm's health: coverage per block, servers, throughput, load.
    Monitor(monitor::MonitorArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The CLI prints results on stdout; logs below warnings would drown them.
    app::run(&cli.common, "warn", async {
        match cli.command {
            Command::Generate(a) => generate::run(a).await,
            Command::Swarm(a) => swarm::run(a).await,
            Command::Demo(a) => demo::run(a).await,
            Command::Api(a) => api::run(a).await,
            Command::Chat(a) => chat::run(a).await,
            Command::Monitor(a) => monitor::run(a).await,
        }
    })
}
