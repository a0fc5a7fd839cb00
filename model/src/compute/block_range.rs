//! `A..B` block ranges as users type them, checked against the model.
use crate::error::{ModelError, Result};
use serde::{Deserialize, Serialize};
use std::fmt;

/// Blocks `start..end` (end exclusive), as in `--blocks 10..20`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct BlockRange {
    pub start: usize,
    pub end: usize,
}

impl BlockRange {
    pub fn new(start: usize, end: usize) -> Self {
        Self { start, end }
    }

    pub fn len(&self) -> usize {
        self.end.saturating_sub(self.start)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn contains(&self, block: usize) -> bool {
        (self.start..self.end).contains(&block)
    }

    /// True when `other` lies inside this range.
    pub fn covers(&self, other: &BlockRange) -> bool {
        other.start >= self.start && other.end <= self.end
    }

    /// Splits blocks `0..blocks` into `n` contiguous, nearly equal spans (at most one per block).
    pub fn split_even(blocks: usize, n: usize) -> Vec<BlockRange> {
        let n = n.clamp(1, blocks.max(1));
        (0..n)
            .map(|i| BlockRange::new(i * blocks / n, (i + 1) * blocks / n))
            .collect()
    }

    /// Parses `A..B`; `..` alone and `A..` / `..B` are not accepted, to keep spans explicit.
    pub fn parse(s: &str) -> Result<Self> {
        let bad = |reason: &str| ModelError::BlockRange {
            range: s.to_string(),
            reason: reason.to_string(),
        };
        let (a, b) = s
            .trim()
            .split_once("..")
            .ok_or_else(|| bad("expected START..END, e.g. 0..10"))?;
        let start = a.trim().parse().map_err(|_| bad("START is not a number"))?;
        let end = b.trim().parse().map_err(|_| bad("END is not a number"))?;
        Ok(Self { start, end })
    }

    /// Checks the range is non-empty, in order and inside a model of `num_blocks` blocks.
    pub fn validate(&self, num_blocks: usize) -> Result<()> {
        let bad = |reason: String| {
            Err(ModelError::BlockRange {
                range: self.to_string(),
                reason,
            })
        };
        if self.start > self.end {
            return bad("start is after end (reversed range)".into());
        }
        if self.start == self.end {
            return bad("the range is empty".into());
        }
        if self.end > num_blocks {
            return bad(format!(
                "the model has {num_blocks} blocks (0..{num_blocks})"
            ));
        }
        Ok(())
    }
}

impl fmt::Display for BlockRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}..{}", self.start, self.end)
    }
}

impl std::str::FromStr for BlockRange {
    type Err = ModelError;
    fn from_str(s: &str) -> Result<Self> {
        Self::parse(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_validates() {
        let r = BlockRange::parse("10..20").unwrap();
        assert_eq!((r.start, r.end, r.len()), (10, 20, 10));
        r.validate(30).unwrap();
    }

    #[test]
    fn splits_evenly() {
        let spans = BlockRange::split_even(30, 3);
        assert_eq!(
            spans,
            vec![
                BlockRange::new(0, 10),
                BlockRange::new(10, 20),
                BlockRange::new(20, 30)
            ]
        );
        assert_eq!(
            BlockRange::split_even(5, 3)
                .iter()
                .map(|r| r.len())
                .sum::<usize>(),
            5
        );
        assert_eq!(BlockRange::split_even(2, 5).len(), 2);
    }

    #[test]
    fn rejects_bad_ranges() {
        for (s, n, needle) in [
            ("10..40", 30, "has 30 blocks"),
            ("5..5", 30, "empty"),
            ("20..10", 30, "reversed"),
        ] {
            let err = BlockRange::parse(s)
                .unwrap()
                .validate(n)
                .unwrap_err()
                .to_string();
            assert!(err.contains(needle), "{s}: {err}");
        }
        assert!(BlockRange::parse("ten..20").is_err());
        assert!(BlockRange::parse("10-20").is_err());
    }
}
