use std::process::ExitCode;

use koder_dns::cli::{Cli, Command};

fn main() -> ExitCode {
    let cli = Cli::parse_args();
    match cli.command {
        Command::Serve(args) => koder_dns::server::main(args),
        Command::Export(args) => koder_dns::cli::export(args),
        Command::Drift(args) => koder_dns::cli::drift(args),
        Command::Agent(args) => koder_dns::cli::agent(args),
        Command::Conformance(args) => koder_dns::cli::conformance(args),
        Command::Migrate(args) => koder_dns::cli::migrate(args),
        Command::Keys(command) => koder_dns::cli::keys(command),
        Command::Dnssec(command) => koder_dns::cli::dnssec(command),
    }
}
