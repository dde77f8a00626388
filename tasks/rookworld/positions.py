"""Seeded chess positions and transitions from python-chess alone: an unlimited offline source.

Four scenarios, drawn per sample, give the spread the tasks need:
- game (55%):       a game from the start position, played by a noisy one-ply heuristic (captures,
                    promotions, castling; temperature drawn per game, from uniformly random to
                    fairly greedy), stopped at a ply drawn from opening (0-16), middlegame (17-60) or
                    endgame (61-180) ranges.
- endgame (20%):    a random legal position with two kings and up to five pieces (pawns often one step
                    from promotion), sometimes with a halfmove clock near the 75-move limit, or with
                    an en-passant capture available.
- decisive (15%):   an endgame position where some move ends the game: mates in one, stalemates,
                    insufficient material and 75-move draws, rare in games, become common.
- repetition (10%): a game, then pieces shuffled back and forth towards a fivefold repetition.

For A: the move played is drawn by category (mate, draw, promotion, castling, en passant, check,
capture, quiet; rare ones weighted up), and about one move in eight is illegal (self-check, the
opponent's piece, a bad promotion, or any from-to pair). Everything depends only on the rng given.
"""
import math
import random

import chess

PIECE_VALUE = {chess.PAWN: 1, chess.KNIGHT: 3, chess.BISHOP: 3, chess.ROOK: 5, chess.QUEEN: 9, chess.KING: 0}

ILLEGAL_SHARE = 0.12
# Weight of each category of move when choosing the A: move; a category is only drawn when the
# position has such a move. Rare, rule-heavy events are weighted up.
MOVE_CATEGORY_WEIGHT = {"mate": 20, "draw": 10, "promotion": 5, "en-passant": 10, "castling": 6,
                        "check": 1.5, "capture": 1.5, "quiet": 1.5}


def _heuristic_move(board: chess.Board, moves: list[chess.Move], rng: random.Random,
                    temperature: float) -> chess.Move:
    """One of the legal `moves`, from a softmax over a cheap one-ply score (no push: runs every ply)."""
    if temperature <= 0 or len(moves) == 1:
        return rng.choice(moves)
    them = not board.turn
    attacked: dict[int, bool] = {}
    best, best_key = moves[0], float("-inf")
    for move in moves:
        mover = board.piece_type_at(move.from_square)
        score = 0.0
        if board.is_capture(move):
            victim = board.piece_type_at(move.to_square) or chess.PAWN   # None: en passant
            score += PIECE_VALUE[victim]
        if move.promotion:
            score += PIECE_VALUE[move.promotion] - 1
        if board.is_castling(move):
            score += 1.5
        if move.to_square not in attacked:
            attacked[move.to_square] = board.is_attacked_by(them, move.to_square)
        if attacked[move.to_square]:
            score -= PIECE_VALUE[mover] * 0.8
        # Gumbel-max: sampling from softmax(score / temperature) without normalising.
        key = score / temperature - _log_neg_log(rng)
        if key > best_key:
            best, best_key = move, key
    return best


def _log_neg_log(rng: random.Random) -> float:
    return math.log(-math.log(rng.random() or 1e-12))


def _play(board: chess.Board, plies: int, rng: random.Random) -> None:
    """Play up to `plies` heuristic moves, stopping early at a game's end."""
    temperature = rng.choice([0.0, 0.5, 1.0, 2.0])   # from uniform random play to fairly greedy
    for _ in range(plies):
        moves = list(board.legal_moves)
        # The game-over test without is_game_over(), which would generate the moves again.
        if (not moves or board.is_insufficient_material() or board.halfmove_clock >= 150
                or (board.halfmove_clock >= 16 and board.is_fivefold_repetition())):
            return
        board.push(_heuristic_move(board, moves, rng, temperature))


def _game_board(rng: random.Random) -> chess.Board:
    board = chess.Board()
    phase = rng.random()
    if phase < 0.35:
        plies = rng.randint(0, 16)       # opening
    elif phase < 0.75:
        plies = rng.randint(17, 60)      # middlegame
    else:
        plies = rng.randint(61, 180)     # endgame (random play rarely ends sooner)
    _play(board, plies, rng)
    return board


def _endgame_board(rng: random.Random) -> chess.Board:
    """A random valid position with two kings and up to five other pieces.

    One in four also gets an en-passant chance: the last move was a double pawn push that lands
    beside an enemy pawn (en passant is otherwise rare in generated games).
    """
    while True:
        board = chess.Board(None)
        squares = rng.sample(chess.SQUARES, 7)
        board.set_piece_at(squares[0], chess.Piece(chess.KING, chess.WHITE))
        board.set_piece_at(squares[1], chess.Piece(chess.KING, chess.BLACK))
        for square in squares[2:2 + rng.randint(1, 5)]:
            color = rng.random() < 0.5
            kind = rng.choice([chess.PAWN, chess.PAWN, chess.PAWN, chess.KNIGHT, chess.BISHOP,
                               chess.ROOK, chess.ROOK, chess.QUEEN])
            if kind == chess.PAWN:
                # pawns one step from promotion make promotions common
                rank = rng.choice([1, 6, 6, 2, 3, 4, 5]) if color else rng.choice([6, 1, 1, 5, 4, 3, 2])
                square = chess.square(chess.square_file(square), rank)
                if board.piece_at(square):
                    continue
            board.set_piece_at(square, chess.Piece(kind, color))
        board.turn = rng.random() < 0.5
        board.halfmove_clock = rng.randint(140, 149) if rng.random() < 0.15 else rng.randint(0, 30)
        board.fullmove_number = rng.randint(30, 90)
        if rng.random() < 0.25:
            _double_push_beside(board, rng)
        if board.is_valid() and not board.is_game_over():
            return board


def _double_push_beside(board: chess.Board, rng: random.Random) -> None:
    """Place a pawn pair so that the side to move may capture en passant, and push the double step."""
    mover = not board.turn                      # the side that makes the double push
    file = rng.randrange(8)
    side_file = file + rng.choice([-1, 1])
    if not 0 <= side_file < 8:
        return
    start, end = (chess.square(file, 1), chess.square(file, 3)) if mover else \
        (chess.square(file, 6), chess.square(file, 4))
    beside = chess.square(side_file, chess.square_rank(end))
    between = (start + end) // 2
    if any(board.piece_at(sq) for sq in (start, end, between, beside)):
        return
    board.set_piece_at(start, chess.Piece(chess.PAWN, mover))
    board.set_piece_at(beside, chess.Piece(chess.PAWN, not mover))
    board.turn = mover
    if board.is_valid() and board.is_legal(chess.Move(start, end)):
        board.push(chess.Move(start, end))
    else:   # undo the set-up; the caller validates the board either way
        board.remove_piece_at(start)
        board.remove_piece_at(beside)
        board.turn = not mover


def _decisive_board(rng: random.Random) -> chess.Board:
    """An endgame position where some legal move ends the game (mate, stalemate, draw), if found soon."""
    for _ in range(40):
        board = _endgame_board(rng)
        for move in board.legal_moves:
            board.push(move)
            over = board.is_game_over()
            board.pop()
            if over:
                return board
    return board


def _repetition_board(rng: random.Random) -> chess.Board:
    """A game, then knight/king/rook shuffles until the position has occurred four or five times."""
    board = chess.Board()
    _play(board, rng.randint(0, 30), rng)
    last: dict[bool, chess.Move] = {}
    for _ in range(rng.randint(10, 15)):   # the 16th ply would end the game
        if board.is_game_over():
            break
        back = last.get(board.turn)
        undo = chess.Move(back.to_square, back.from_square) if back else None
        if undo is not None and board.is_legal(undo) and not board.is_capture(undo):
            move = undo
        else:
            quiet = [m for m in board.legal_moves if not board.is_capture(m) and not board.is_castling(m)
                     and board.piece_type_at(m.from_square) != chess.PAWN]
            move = rng.choice(quiet) if quiet else rng.choice(list(board.legal_moves))
        last[board.turn] = move
        board.push(move)
    return board


def random_board(rng: random.Random) -> chess.Board:
    """A position (with its move stack) where the side to move has a legal move."""
    while True:
        scenario = rng.choices([_game_board, _endgame_board, _decisive_board, _repetition_board],
                               weights=[0.55, 0.2, 0.15, 0.1])[0]
        board = scenario(rng)
        if not board.is_game_over():
            return board


def move_category(board: chess.Board, move: chess.Move) -> str:
    """The category a legal move is drawn under (first match in this order)."""
    board.push(move)
    try:
        if board.is_checkmate():
            return "mate"
        if board.is_game_over():
            return "draw"
        check = board.is_check()
    finally:
        board.pop()
    if move.promotion:
        return "promotion"
    if board.is_en_passant(move):
        return "en-passant"
    if board.is_castling(move):
        return "castling"
    if check:
        return "check"
    return "capture" if board.is_capture(move) else "quiet"


def illegal_move(board: chess.Board, rng: random.Random) -> chess.Move:
    """A syntactically valid move that is not legal here, of one of several kinds."""
    # chosen from in generation order: a set of moves iterates in the order of their hashes, and a Move's hash
    # includes hash(None), which before Python 3.12 is None's address: another order in every process
    ordered = list(board.legal_moves)
    legal = set(ordered)   # membership only
    kinds = {
        # pseudo-legal but leaves or puts the own king in check
        "self-check": [m for m in board.pseudo_legal_moves if m not in legal],
        # moves of the opponent's pieces
        "wrong-side": [m for m in _pseudo_legal_for(board, not board.turn) if m not in legal],
        # a pawn move to the last rank without a promotion piece, or a promotion elsewhere
        "bad-promotion": [chess.Move(m.from_square, m.to_square) for m in ordered if m.promotion]
        + [chess.Move(m.from_square, m.to_square, chess.QUEEN) for m in ordered
           if not m.promotion and board.piece_type_at(m.from_square) == chess.PAWN],
    }
    choices = [name for name, moves in kinds.items() if moves]
    if choices and rng.random() < 0.7:
        return rng.choice(kinds[rng.choice(choices)])
    while True:   # any from-to pair, mostly starting on an own piece
        own = list(board.pieces(rng.choice(list(chess.PIECE_TYPES)), board.turn)) or list(chess.SQUARES)
        move = chess.Move(rng.choice(own) if rng.random() < 0.8 else rng.choice(chess.SQUARES),
                          rng.choice(chess.SQUARES))
        if move.from_square != move.to_square and move not in legal:
            return move


def _pseudo_legal_for(board: chess.Board, color: bool) -> list[chess.Move]:
    flipped = board.copy(stack=False)
    flipped.turn = color
    flipped.ep_square = None
    return list(flipped.pseudo_legal_moves)


def random_transition(rng: random.Random) -> tuple[chess.Board, chess.Move]:
    """A position with its move stack and a move to play in it (legal or, sometimes, not)."""
    board = random_board(rng)
    if rng.random() < ILLEGAL_SHARE:
        return board, illegal_move(board, rng)
    by_category: dict[str, list[chess.Move]] = {}
    for move in board.legal_moves:
        by_category.setdefault(move_category(board, move), []).append(move)
    names = list(by_category)
    name = rng.choices(names, weights=[MOVE_CATEGORY_WEIGHT[n] for n in names])[0]
    return board, rng.choice(by_category[name])


def history(board: chess.Board, move: chess.Move) -> list[str]:
    """The A: history: the last moves of the game, up to 10, ending with `move` itself."""
    return [m.uci() for m in board.move_stack[-9:]] + [move.uci()]
