// Module tools pins the code generators that `make generate` runs, apart from the product's go.mod so
// that their dependencies never reach the programs Berth ships.
package tools
