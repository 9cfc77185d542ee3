pub mod frames;
pub mod netns;
