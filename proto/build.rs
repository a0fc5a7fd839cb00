//! Compiles `proto/petal.proto` into Rust with prost.
//!
//! The .proto is parsed by `protox` (pure Rust) instead of a system `protoc`, so the crate builds anywhere cargo
//! runs: no toolchain beyond rustc, identical output on every machine.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    const PROTO: &str = "proto/petal.proto";
    println!("cargo:rerun-if-changed={PROTO}");
    println!("cargo:rerun-if-changed=build.rs");

    let fds = protox::compile([PROTO], ["proto"])?;
    prost_build::Config::new().compile_fds(fds)?;
    Ok(())
}
