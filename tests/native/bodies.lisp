;;;; bodies.lisp -- bytes in, bytes out: every response body shape the native
;;;; app API allows, holding every octet value and strings with CR, LF, NUL,
;;;; TAB and characters beyond ASCII, small (head and body in one output
;;;; buffer) and large, read back byte by byte by a strict client on
;;;; keep-alive connections, so that a body changed in flight or a wrong
;;;; Content-Length (which breaks the next answer) is seen.
;;;;
;;;; Also the strict response reader and the random content that
;;;; tests/hunchentoot/bodies.lisp uses for Hunchentoot handlers.

(in-package #:gallop-tests)
(in-suite native)

;;; A strict response reader: a wire error on anything an HTTP/1.1 response
;;; must not contain, so a test sees malformed framing and not just a wrong
;;; body.

(define-condition exact-wire-error (error)
  ((text :initarg :text :reader exact-wire-error-text))
  (:report (lambda (condition stream) (write-string (exact-wire-error-text condition) stream)))
  (:documentation "The response on the wire is not a valid HTTP/1.1 message."))

(defun exact-wire-error (control &rest arguments)
  (error 'exact-wire-error :text (apply #'format nil control arguments)))

(defstruct (exact-response (:conc-name exact-))
  "One response as READ-EXACT-RESPONSE read it."
  status
  reason
  headers                               ; ((name . value) ...) in order, values trimmed
  body                                  ; octets, or NIL when the answer has none
  framing                               ; :content-length, :chunked, :close or :none
  chunk-sizes)                          ; the sizes of the data chunks, in order

(defun read-wire-line (stream what &key (limit 65536))
  "One line ending in CRLF, without the CRLF, as a string of the octets'
latin-1 characters.  A WIRE-ERROR at end of file, on a bare LF or a CR not
followed by LF, or past LIMIT octets."
  (let ((line (make-array 64 :element-type 'character :adjustable t :fill-pointer 0)))
    (loop
      (let ((b (read-byte stream nil nil)))
        (cond ((null b)
               (exact-wire-error "end of file in the ~A after ~S" what (coerce line 'string)))
              ((= b 13)
               (if (eql (read-byte stream nil nil) 10)
                   (return (coerce line 'string))
                   (exact-wire-error "a bare CR in the ~A ~S" what (coerce line 'string))))
              ((= b 10)
               (exact-wire-error "a bare LF in the ~A ~S" what (coerce line 'string)))
              ((>= (length line) limit)
               (exact-wire-error "the ~A is longer than ~D octets" what limit))
              (t (vector-push-extend (code-char b) line)))))))

(defun tchar-p (char)
  "True for the characters of an RFC 9110 token."
  (or (char<= #\a char #\z) (char<= #\A char #\Z) (char<= #\0 char #\9)
      (find char "!#$%&'*+-.^_`|~")))

(defun exact-parse-status-line (line)
  "(values status reason) of \"HTTP/1.1 DDD reason\"; a WIRE-ERROR otherwise."
  (unless (and (>= (length line) 13)
               (string= "HTTP/1.1 " line :end2 9)
               (every #'digit-char-p (subseq line 9 12))
               (char= #\Space (char line 12))
               (every (lambda (c) (or (char= c #\Tab) (char<= #\Space c #\~) (char>= c (code-char #x80))))
                      (subseq line 13)))
    (exact-wire-error "a malformed status line ~S" line))
  (values (parse-integer line :start 9 :end 12) (subseq line 13)))

(defun exact-parse-field-line (line what)
  "(name . value) of a field line \"name: value\", the value without the
whitespace around it; a WIRE-ERROR for an empty or non-token name, or a
control character other than HTAB in the value."
  (let ((colon (position #\: line)))
    (unless (and colon (plusp colon) (every #'tchar-p (subseq line 0 colon)))
      (exact-wire-error "a malformed ~A ~S" what line))
    (let ((value (string-trim '(#\Space #\Tab) (subseq line (1+ colon)))))
      (when (find-if (lambda (c) (or (and (< (char-code c) 32) (char/= c #\Tab))
                                     (= (char-code c) 127)))
                     value)
        (exact-wire-error "a control character in the ~A ~S" what line))
      (cons (subseq line 0 colon) value))))

(defun exact-header-values (response name)
  (loop for (key . value) in (exact-headers response)
        when (string-equal key name) collect value))

(defun exact-header (response name)
  "The value of the header NAME, NIL when absent; a WIRE-ERROR when repeated."
  (let ((values (exact-header-values response name)))
    (when (cdr values)
      (exact-wire-error "the header ~A appears ~D times" name (length values)))
    (first values)))

(defun read-octets-exactly (stream count what)
  "COUNT octets from STREAM; a WIRE-ERROR if it ends before."
  (let* ((octets (make-array count :element-type '(unsigned-byte 8)))
         (got (read-sequence octets stream)))
    (unless (= got count)
      (exact-wire-error "the ~A ends after ~D of ~D octets" what got count))
    octets))

(defun read-chunked-strictly (stream)
  "A chunked body, its framing checked exactly: size lines of hex digits
only, each chunk's data followed by CRLF, a last chunk of zeros, field
lines as trailers, and the final CRLF.  (values body chunk-sizes)"
  (let ((body (make-array 0 :element-type '(unsigned-byte 8) :adjustable t :fill-pointer 0))
        (sizes '()))
    (loop
      (let ((line (read-wire-line stream "chunk size line" :limit 1024)))
        (unless (and (< 0 (length line) 16) (every (lambda (c) (digit-char-p c 16)) line))
          (exact-wire-error "a malformed chunk size line ~S" line))
        (let ((size (parse-integer line :radix 16)))
          (when (zerop size)
            (return))
          (push size sizes)
          (loop for b across (read-octets-exactly stream size "chunk")
                do (vector-push-extend b body))
          (unless (and (eql 13 (read-byte stream nil nil)) (eql 10 (read-byte stream nil nil)))
            (exact-wire-error "chunk data of ~D octets not followed by CRLF" size)))))
    (loop for line = (read-wire-line stream "trailer section")
          until (zerop (length line))
          do (exact-parse-field-line line "trailer line"))
    (values (coerce body '(simple-array (unsigned-byte 8) (*))) (nreverse sizes))))

(defun read-exact-response (stream &key head)
  "Read one HTTP/1.1 response from STREAM strictly (HEAD: the answer to a
HEAD request, so no body).  Every line must end in CRLF; the status line
must be \"HTTP/1.1 DDD reason\"; every header line \"name: value\" with a
token name and no control characters in the value; at most one
Content-Length (digits only) and one Transfer-Encoding (\"chunked\" only),
not both; the body exactly as framed.  Returns an EXACT-RESPONSE or
signals a WIRE-ERROR."
  (multiple-value-bind (status reason)
      (exact-parse-status-line (read-wire-line stream "status line"))
    (let* ((headers (loop for line = (read-wire-line stream "header section")
                          until (zerop (length line))
                          collect (exact-parse-field-line line "header line")))
           (response (make-exact-response :status status :reason reason :headers headers
                                          :framing :none))
           (length (exact-header response "Content-Length"))
           (coding (exact-header response "Transfer-Encoding")))
      (when (and length (not (and (plusp (length length)) (every #'digit-char-p length))))
        (exact-wire-error "a malformed Content-Length ~S" length))
      (when (and length coding)
        (exact-wire-error "both Content-Length and Transfer-Encoding"))
      (when (and coding (string-not-equal coding "chunked"))
        (exact-wire-error "a Transfer-Encoding other than chunked: ~S" coding))
      (cond ((or head (< status 200) (= status 204) (= status 304)))
            (coding
             (multiple-value-bind (body sizes) (read-chunked-strictly stream)
               (setf (exact-body response) body
                     (exact-chunk-sizes response) sizes
                     (exact-framing response) :chunked)))
            (length
             (setf (exact-body response) (read-octets-exactly stream (parse-integer length) "body")
                   (exact-framing response) :content-length))
            (t
             (unless (string-equal (exact-header response "Connection") "close")
               (exact-wire-error "a body framed by nothing, on a connection not closed"))
             (setf (exact-body response)
                   (coerce (read-to-eof stream) '(simple-array (unsigned-byte 8) (*)))
                   (exact-framing response) :close)))
      response)))

;;; Random content, from a fixed seed

(defparameter *bodies-seed* 1313
  "The seed of the body property tests: the same cases on every run.")

(defun make-bodies-rng ()
  (sb-ext:seed-random-state *bodies-seed*))

(defun pick (rng list)
  (nth (random (length list) rng) list))

(defun utf-8-octets (string)
  "STRING in UTF-8, encoded here (not with the encoder the server uses)."
  (let ((out (make-array (* 4 (length string)) :element-type '(unsigned-byte 8) :fill-pointer 0)))
    (flet ((put (b) (vector-push b out)))
      (loop for char across string
            for c = (char-code char)
            do (cond ((< c #x80) (put c))
                     ((< c #x800)
                      (put (logior #xC0 (ash c -6)))
                      (put (logior #x80 (logand c #x3F))))
                     ((< c #x10000)
                      (put (logior #xE0 (ash c -12)))
                      (put (logior #x80 (logand (ash c -6) #x3F)))
                      (put (logior #x80 (logand c #x3F))))
                     (t
                      (put (logior #xF0 (ash c -18)))
                      (put (logior #x80 (logand (ash c -12) #x3F)))
                      (put (logior #x80 (logand (ash c -6) #x3F)))
                      (put (logior #x80 (logand c #x3F)))))))
    (coerce out '(simple-array (unsigned-byte 8) (*)))))

(defun piece-octets (piece)
  "What a body piece (string or octet vector) must arrive as."
  (if (stringp piece)
      (utf-8-octets piece)
      (coerce piece '(simple-array (unsigned-byte 8) (*)))))

(defun pieces-octets (pieces)
  (let ((all (mapcar #'piece-octets pieces)))
    (apply #'concatenate '(simple-array (unsigned-byte 8) (*)) all)))

(defparameter *special-chars*
  (list (code-char 13) (code-char 10) (code-char 0) (code-char 9)
        (code-char #xE9) (code-char #xFF) (code-char #xA0) (code-char #x80)
        (code-char #x3BB) (code-char #x7FF) (code-char #x800) (code-char #x20AC)
        (code-char #xFFFD) (code-char #xFFFF) (code-char #x10000) (code-char #x1F600)
        (code-char #x10FFFF))
  "CR, LF, NUL, TAB, latin-1 (é ÿ NBSP), and the edges of each UTF-8 length
with λ € and an emoji between.")

(defun random-size (rng)
  "A body piece size: often empty or small (head and body in one 8 KiB
output buffer), some around the buffer's size, a few of 20 and 200 KiB."
  (let ((r (random 100 rng)))
    (cond ((< r 10) 0)
          ((< r 45) (1+ (random 64 rng)))
          ((< r 70) (+ 65 (random 2000 rng)))
          ((< r 88) (+ 7600 (random 1000 rng)))
          ((< r 97) (* 20 1024))
          (t (* 200 1024)))))

(defun random-char (rng alphabet)
  "A character of ALPHABET (:ASCII, :LATIN-1 or :UNICODE), the control
characters and the edge cases weighted up."
  (let ((specials (ecase alphabet
                    (:ascii (subseq *special-chars* 0 4))
                    (:latin-1 (subseq *special-chars* 0 8))
                    (:unicode *special-chars*))))
    (if (zerop (random 4 rng))
        (pick rng specials)
        (code-char (ecase alphabet
                     (:ascii (random 128 rng))
                     (:latin-1 (random 256 rng))
                     (:unicode (let ((c (random #x11000 rng)))
                                 ;; no surrogates: they are not characters UTF-8 can carry
                                 (if (<= #xD800 c #xDFFF) (- c #x800) c))))))))

(defun random-string (rng &key (size (random-size rng))
                                (alphabet (pick rng '(:ascii :ascii :latin-1 :unicode))))
  "A random string: usually simple, sometimes a base string (when ASCII)
or a string with a fill pointer, junk past it, that must not be sent."
  (let ((chars (loop repeat size collect (random-char rng alphabet)))
        (representation (random 6 rng)))
    (cond ((and (= representation 0) (every (lambda (c) (< (char-code c) 128)) chars))
           (coerce chars 'simple-base-string))
          ((= representation 1)
           (let ((s (make-array (+ size 7) :element-type 'character :initial-element #\Z
                                           :fill-pointer size)))
             (replace s chars)
             s))
          (t (coerce chars '(simple-array character (*)))))))

(defun random-octets (rng &key (size (random-size rng)))
  "A random octet vector: every value 0-255 in turn from a random start, or
random values; sometimes with a fill pointer and junk past it."
  (let ((v (make-array size :element-type '(unsigned-byte 8)))
        (start (random 256 rng))
        (counting (zerop (random 3 rng))))
    (dotimes (i size)
      (setf (aref v i) (if counting (mod (+ start i) 256) (random 256 rng))))
    (if (zerop (random 6 rng))
        (let ((w (make-array (+ size 5) :element-type '(unsigned-byte 8) :initial-element 90
                                        :fill-pointer size)))
          (replace w v)
          w)
        v)))

(defun random-piece (rng)
  (if (zerop (random 2 rng)) (random-string rng) (random-octets rng)))

(defun all-octet-values ()
  (let ((v (make-array 256 :element-type '(unsigned-byte 8))))
    (dotimes (i 256 v) (setf (aref v i) i))))

(defun describe-piece (piece)
  (format nil "~:[octets~;~:*~A~] ~D~@[ (fill pointer)~]"
          (typecase piece
            (simple-base-string "base-string")
            (string "string"))
          (length piece) (array-has-fill-pointer-p piece)))

(defun first-difference (expected actual)
  "NIL when the octet vectors are equal, else a description of where they
first differ."
  (let ((index (mismatch expected actual))
        (*print-pretty* nil))
    (when index
      (format nil "~D octets expected, ~D received, first difference at ~D: expected ~S, received ~S"
              (length expected) (length actual) index
              (subseq expected index (min (length expected) (+ index 8)))
              (subseq actual index (min (length actual) (+ index 8)))))))

;;; Running exchanges on keep-alive connections

(defstruct exchange
  "One request of a body test and how to judge its answer."
  label                                 ; for failure messages
  target                                ; the request target
  head                                  ; a HEAD request
  check                                 ; (lambda (response)) -> list of problems
  may-close)                            ; the server may close the connection after it

(defun run-exchanges (port exchanges &key (per-connection 8) (max-failures 10))
  "Send EXCHANGES in order, PER-CONNECTION on each keep-alive connection
(the last with Connection: close, after which the server must close it),
reading each answer with READ-EXACT-RESPONSE: a wrong Content-Length or
stray bytes break the next answer.  One FiveAM check per exchange, naming
its problems.  Stops after MAX-FAILURES failed exchanges, so that a broken
server costs a bounded time.  Returns how many exchanges were checked."
  (let ((socket nil) (on-socket 0) (failures 0) (checked 0))
    (flet ((drop ()
             (when socket
               (usocket:socket-close socket)
               (setf socket nil on-socket 0))))
      (unwind-protect
           (loop for (x . more) on exchanges
                 while (< failures max-failures)
                 do (unless socket (setf socket (connect port :timeout 5)))
                    (let* ((last (or (null more) (= (1+ on-socket) per-connection)))
                           (stream (usocket:socket-stream socket))
                           (problems '())
                           (closed nil))
                      (send socket (apply #'crlf (format nil "~:[GET~;HEAD~] ~A HTTP/1.1"
                                                         (exchange-head x) (exchange-target x))
                                          "Host: x"
                                          (and last '("Connection: close"))))
                      (incf on-socket)
                      (handler-case
                          (let ((response (read-exact-response stream :head (exchange-head x))))
                            (setf problems (funcall (exchange-check x) response))
                            (let ((close (string-equal "close" (exact-header response "Connection"))))
                              (cond ((and last (not close))
                                     (push "no Connection: close after one was asked for" problems))
                                    ((and close (not last) (not (exchange-may-close x)))
                                     (push "Connection: close on a keep-alive exchange" problems)))
                              (when close
                                (setf closed t)
                                (unless (closed-by-peer-p socket)
                                  (push "more octets, or no end of file, after the last answer"
                                        problems)))))
                        (error (e)
                          (push (format nil "~A" e) problems)))
                      (incf checked)
                      (is (null problems) "~A:~{ ~A~^;~}" (exchange-label x) problems)
                      (when problems (incf failures))
                      (when (or problems closed last) (drop))))
        (drop)))
    checked))

(defun header-problems (response expected-headers)
  "Problems with RESPONSE's headers: EXPECTED-HEADERS ((name . value) ...,
value NIL for \"absent\") not as given, a repeated header, no Date."
  (let ((problems '())
        (names (mapcar #'car (exact-headers response))))
    (loop for (name . more) on names
          when (member name more :test #'string-equal)
            do (push (format nil "the header ~A is repeated" name) problems))
    (loop for (name . value) in expected-headers
          for got = (first (exact-header-values response name))
          unless (equal value got)
            do (push (format nil "~A: ~S expected, ~S received" name value got) problems))
    (unless (exact-header-values response "Date")
      (push "no Date" problems))
    problems))

(defun body-problems (response expected &key head streamed)
  "Problems with RESPONSE's framing and body, EXPECTED being the octets the
GET answer carries.  STREAMED: the length is unknown, so a GET answer must
be chunked and a HEAD answer has no Content-Length."
  (let ((problems '())
        (length (exact-header response "Content-Length")))
    (flet ((problem (control &rest arguments)
             (push (apply #'format nil control arguments) problems)))
      (cond (head
             (cond ((not streamed)
                    (unless (equal length (princ-to-string (length expected)))
                      (problem "HEAD: Content-Length ~S, ~D expected" length (length expected))))
                   (length
                    (problem "HEAD of a streamed answer: Content-Length ~S" length))))
            (t
             (let ((framing (if streamed :chunked :content-length)))
               (unless (eq framing (exact-framing response))
                 (problem "framed by ~S, ~S expected" (exact-framing response) framing)))
             (let ((difference (first-difference expected (exact-body response))))
               (when difference (problem "body: ~A" difference))))))
    problems))

;;; The native app's cases

(defstruct native-case
  id
  shape     ; :string :strings :mixed :octets :file :stream :stream-thread
            ; :stream-length :delayed :delayed-thread
  inner     ; for :delayed and :delayed-thread: the body's shape
  status
  pieces    ; the strings and octet vectors of the body, in order
  body      ; what the app returns as body (not for the streaming shapes)
  note      ; the X-Note header value the app gives (or NIL)
  close-with-last  ; streaming: :CLOSE T comes with the last piece
  expected) ; the octets the client must receive

(defun streamed-shape-p (shape) (member shape '(:stream :stream-thread)))

(defun expected-note (note)
  "What the header value NOTE must arrive as: CR and LF neutralised to
spaces (no header can be injected), characters beyond latin-1 as ?, and
without the whitespace around it."
  (etypecase note
    (null nil)
    (integer (princ-to-string note))
    (string (string-trim '(#\Space #\Tab)
                         (map 'string (lambda (c)
                                        (cond ((member c '(#\Return #\Linefeed)) #\Space)
                                              ((> (char-code c) 255) #\?)
                                              (t c)))
                              note)))))

(defun build-native-case (id shape pieces directory
                          &key inner (status 200) note (close-with-last nil))
  "A NATIVE-CASE whose body is PIECES in SHAPE (:FILE pieces are written
to a file in DIRECTORY)."
  (let* ((expected (pieces-octets pieces))
         (body (ecase (or inner shape)
                 (:string (assert (and (= 1 (length pieces)) (stringp (first pieces))))
                  pieces)
                 ((:strings :mixed) pieces)
                 (:octets (assert (and (= 1 (length pieces)) (not (stringp (first pieces)))))
                  (first pieces))
                 (:file (let ((path (merge-pathnames (format nil "case-~D" id) directory)))
                          (with-open-file (out path :direction :output :if-exists :supersede
                                                    :element-type '(unsigned-byte 8))
                            (write-sequence expected out))
                          path))
                 ((:stream :stream-thread :stream-length) nil))))
    (make-native-case :id id :shape shape :inner inner :status status :pieces pieces :body body
                      :note note :close-with-last close-with-last :expected expected)))

(defun native-case-label (case head)
  (format nil "case ~D ~:[GET~;HEAD~] ~(~A~)~@[/~(~A~)~] ~D ~A [~{~A~^, ~}]~@[ note ~D chars~]"
          (native-case-id case) head (native-case-shape case) (native-case-inner case)
          (native-case-status case)
          (if (native-case-close-with-last case) "close-with-last" "close-apart")
          (mapcar #'describe-piece (native-case-pieces case))
          (let ((note (native-case-note case))) (and (stringp note) (length note)))))

(defun fixed-native-cases (directory)
  "The cases every run has whatever the seed: the LF of issue 13, the
control characters, every octet value, and an empty body in each shape."
  (let ((id -1)
        (cr (string #\Return)) (lf (string #\Linefeed))
        (nul (string (code-char 0))) (tab (string #\Tab)))
    (flet ((case* (shape pieces &rest options)
             (apply #'build-native-case (incf id) shape pieces directory options)))
      (list
       (case* :string (list (format nil "a~%b")))
       (case* :string (list (concatenate 'string "x" cr lf "y" cr "z" lf nul tab "end" cr)))
       (case* :string (list (coerce (loop for i below 128 collect (code-char i)) 'string)))
       (case* :string (list (coerce (loop for i below 128 collect (code-char i)) 'simple-base-string)))
       (case* :string (list (coerce (list #\a (code-char #x3BB) (code-char #xE9) (code-char #x1F600) #\Newline)
                                    'string)))
       ;; head and body in one buffer, and just past it
       (case* :string (list (with-output-to-string (s) (dotimes (i 800) (format s "line ~3D~%" i)))))
       (case* :string (list (with-output-to-string (s) (dotimes (i 920) (format s "line ~3D~%" i)))))
       (case* :octets (list (all-octet-values)))
       (case* :mixed (list (format nil "~A~%" (code-char #x3BB)) (all-octet-values) (concatenate 'string cr lf)))
       (case* :file (list (all-octet-values)))
       (case* :stream (list (all-octet-values) (format nil "a~%b") (string (code-char #x1F600))))
       (case* :delayed (list (format nil "a~%b")) :inner :string)
       (case* :delayed-thread (list (format nil "a~Cb" #\Return)) :inner :string)
       (case* :string (list "ok") :note (concatenate 'string "a" cr lf "Injected: yes"))
       (case* :string (list "ok") :note (concatenate 'string "a" lf "Injected: yes" lf lf))
       ;; empty bodies, in each shape
       (case* :string (list ""))
       (case* :string (list (coerce "" 'simple-base-string)))
       (case* :strings '())
       (case* :strings (list "" ""))
       (case* :mixed (list "" (make-array 0 :element-type '(unsigned-byte 8))))
       (case* :octets (list (make-array 0 :element-type '(unsigned-byte 8))))
       (case* :file '())
       (case* :stream '())
       (case* :stream (list "" (make-array 0 :element-type '(unsigned-byte 8))) :close-with-last t)
       (case* :stream-thread '())
       (case* :stream-length '())
       (case* :delayed (list "") :inner :string)
       (case* :delayed (list (make-array 0 :element-type '(unsigned-byte 8))) :inner :octets)
       (case* :delayed-thread '() :inner :file)
       (case* :delayed-thread '() :inner :strings)))))

(defun random-note (rng)
  "A header value for X-Note: mostly none; strings with CR and LF (that
must not inject a header) and characters beyond latin-1; an integer, or a
value too long for the head's one-buffer path (the general path)."
  (let ((r (random 100 rng)))
    (cond ((< r 40) nil)
          ((< r 75)
           (concatenate 'string
                        ;; No other control characters: Gallop passes them
                        ;; through (a header value must not hold them).
                        (remove-if (lambda (c)
                                     (and (or (< (char-code c) 32) (= (char-code c) 127))
                                          (not (member c '(#\Return #\Linefeed #\Tab)))))
                                   (random-string rng :size (random 40 rng) :alphabet :unicode))
                        (format nil "~C~CInjected: yes" #\Return #\Linefeed)))
          ((< r 85) (random 1000000 rng))
          (t (coerce (loop repeat 9000 collect (pick rng (list #\a #\Space #\Return #\Linefeed
                                                                (code-char #xE9) (code-char #x3BB))))
                     'string)))))

(defun random-native-case (rng id directory)
  (let* ((shape (pick rng '(:string :string :string :strings :mixed :octets :file :stream
                            :stream-thread :stream-length :delayed :delayed-thread)))
         (inner (and (member shape '(:delayed :delayed-thread))
                     (pick rng '(:string :strings :mixed :octets :file))))
         (pieces (ecase (or inner shape)
                   (:string (list (random-string rng)))
                   (:strings (loop repeat (random 5 rng) collect (random-string rng)))
                   (:octets (list (random-octets rng)))
                   ((:mixed :file :stream :stream-thread :stream-length)
                    (loop repeat (random 5 rng) collect (random-piece rng))))))
    (build-native-case id shape pieces directory
                       :inner inner
                       :status (pick rng '(200 200 200 201 404 500 503))
                       :note (random-note rng)
                       :close-with-last (zerop (random 2 rng)))))

(defun native-case-headers (case)
  (let ((note (native-case-note case)))
    (list* :content-type "text/plain; charset=utf-8"
           (and note (list :x-note note)))))

(defun body-cases-app (cases spawn)
  "An app answering the request target /N with case N of the vector CASES,
in its shape.  SPAWN runs a function in a new thread (joined by the test)."
  (lambda (env)
    (let* ((case (svref cases (parse-integer (getf env :path-info) :start 1)))
           (status (native-case-status case))
           (headers (native-case-headers case))
           (pieces (native-case-pieces case)))
      (labels ((stream-to (writer)
                 (loop for (piece . more) on pieces
                       do (if (and (null more) (native-case-close-with-last case))
                              (funcall writer piece :close t)
                              (funcall writer piece)))
                 (unless (and pieces (native-case-close-with-last case))
                   (funcall writer nil :close t)))
               (full () (list status headers (native-case-body case))))
        (ecase (native-case-shape case)
          ((:string :strings :mixed :octets :file) (full))
          (:delayed (lambda (responder) (funcall responder (full))))
          (:delayed-thread (lambda (responder) (funcall spawn (lambda () (funcall responder (full))))))
          (:stream (lambda (responder) (stream-to (funcall responder (list status headers)))))
          (:stream-thread
           (lambda (responder)
             (let ((writer (funcall responder (list status headers))))
               (funcall spawn (lambda () (stream-to writer))))))
          (:stream-length
           (lambda (responder)
             (stream-to (funcall responder
                                 (list status
                                       (list* :content-length
                                              (princ-to-string (length (native-case-expected case)))
                                              headers)))))))))))

(defun native-case-problems (case head response)
  (let ((problems '()))
    (unless (eql (native-case-status case) (exact-status response))
      (push (format nil "status ~D, ~D expected" (exact-status response) (native-case-status case))
            problems))
    (append problems
            (header-problems response
                             `(("Content-Type" . "text/plain; charset=utf-8")
                               ("X-Note" . ,(expected-note (native-case-note case)))
                               ("Injected" . nil)))
            (body-problems response (native-case-expected case)
                           :head head :streamed (streamed-shape-p (native-case-shape case))))))

(test native-bodies-arrive-exactly
  "Property: whatever body the app gives, in whatever shape, the client
receives exactly its octets (strings in UTF-8), with the right framing,
on a keep-alive connection; HEAD answers carry the length and no body."
  (let* ((rng (make-bodies-rng))
         (directory (uiop:ensure-directory-pathname
                     (format nil "/tmp/gallop-bodies-~D-~D" (sb-posix:getpid) (random 1000000))))
         (threads '())
         (lock (sb-thread:make-mutex :name "body test threads"))
         (spawn (lambda (function)
                  (sb-thread:with-mutex (lock)
                    (push (sb-thread:make-thread function :name "body test responder") threads)))))
    (ensure-directories-exist directory)
    (unwind-protect
         (let* ((fixed (fixed-native-cases directory))
                (cases (coerce (append fixed
                                       (loop for id from (length fixed) repeat 160
                                             collect (random-native-case rng id directory)))
                               'simple-vector))
                (exchanges
                  (loop for case across cases
                        for id = (native-case-id case)
                        append (loop for head in (if (or (< id (length fixed)) (zerop (random 3 rng)))
                                                     '(nil t)
                                                     '(nil))
                                     collect (let ((case case) (head head))
                                               (make-exchange
                                                :label (native-case-label case head)
                                                :target (format nil "/~D" id)
                                                :head head
                                                :check (lambda (r) (native-case-problems case head r))
                                                ;; Streamed with no length: a HEAD answer
                                                ;; closes (neither length nor chunks).
                                                :may-close (and head (streamed-shape-p
                                                                      (native-case-shape case)))))))))
           (with-app (server (body-cases-app cases spawn))
             (is (= (length exchanges) (run-exchanges (native-port server) exchanges)))))
      (mapc #'sb-thread:join-thread (sb-thread:with-mutex (lock) threads))
      (uiop:delete-directory-tree directory :validate t :if-does-not-exist :ignore))))

(test native-header-values-cannot-inject-headers
  "CR and LF in a header value become spaces on both of the head writer's
paths (one buffer, and in parts for a head larger than the buffer), and
the body after such a head is still exact."
  (let ((value (format nil "a~C~CInjected: yes~Cb~Cc" #\Return #\Linefeed #\Linefeed #\Return))
        (body (format nil "x~C~Cy~%" #\Return #\Linefeed)))
    (with-app (server (lambda (env)
                        (list 200 (list :content-type "text/plain"
                                        :x-value value
                                        :x-long (if (string= (getf env :path-info) "/long")
                                                    (make-string 9000 :initial-element #\a)
                                                    "short"))
                              (list body))))
      (let ((socket (connect (native-port server) :timeout 5)))
        (unwind-protect
             (dolist (path '("/short" "/long" "/short"))
               (send socket (crlf (format nil "GET ~A HTTP/1.1" path) "Host: x"))
               (let ((r (read-exact-response (usocket:socket-stream socket))))
                 (is (equal "a  Injected: yes b c" (exact-header r "X-Value")))
                 (is (null (exact-header r "Injected")))
                 (is (equalp (utf-8-octets body) (exact-body r)))))
          (usocket:socket-close socket))))))

(defun wire (&rest parts)
  "Octets of PARTS: strings as they are, :CRLF :CR :LF :NUL as those octets."
  (octets (format nil "~{~A~}"
                  (loop for part in parts
                        collect (case part
                                  (:crlf (format nil "~C~C" #\Return #\Linefeed))
                                  (:cr (string #\Return))
                                  (:lf (string #\Linefeed))
                                  (:nul (string (code-char 0)))
                                  (t part))))))

(test strict-reader-rejects-malformed-responses
  "The strict reader itself: each malformed response is a WIRE-ERROR, a
well-formed one is read exactly."
  (flet ((read-it (&rest parts)
           (read-exact-response
            (flexi-streams:make-in-memory-input-stream (apply #'wire parts)))))
    (let ((r (read-it "HTTP/1.1 200 OK" :crlf "Content-Length: 3" :crlf :crlf "a" :lf "b")))
      (is (equalp (wire "a" :lf "b") (exact-body r)))
      (is (eq :content-length (exact-framing r))))
    (let ((r (read-it "HTTP/1.1 200 OK" :crlf "Transfer-Encoding: chunked" :crlf :crlf
                      "2" :crlf "ab" :crlf "1" :crlf :cr :crlf "00" :crlf "T: x" :crlf :crlf)))
      (is (equalp (wire "ab" :cr) (exact-body r)))
      (is (equal '(2 1) (exact-chunk-sizes r))))
    (macrolet ((bad (&rest parts) `(signals exact-wire-error (read-it ,@parts))))
      (bad "HTTP/1.1 200 OK" :lf "Content-Length: 0" :crlf :crlf)
      (bad "HTTP/1.1 200 OK" :crlf "Content-Length: 0" :cr "X: y" :crlf :crlf)
      (bad "HTTP/1.1 200" :crlf "Content-Length: 0" :crlf :crlf)
      (bad "HTTP/1.0 200 OK" :crlf "Content-Length: 0" :crlf :crlf)
      (bad "HTTP/1.1 200 OK" :crlf "Content-Length: 5" :crlf :crlf "abc")
      (bad "HTTP/1.1 200 OK" :crlf "Content-Length: 1" :crlf "Content-Length: 1" :crlf :crlf "a")
      (bad "HTTP/1.1 200 OK" :crlf "Content-Length: +1" :crlf :crlf "a")
      (bad "HTTP/1.1 200 OK" :crlf "X: a" :nul "b" :crlf "Content-Length: 0" :crlf :crlf)
      (bad "HTTP/1.1 200 OK" :crlf "X : a" :crlf "Content-Length: 0" :crlf :crlf)
      (bad "HTTP/1.1 200 OK" :crlf "Content-Length: 1" :crlf "Transfer-Encoding: chunked" :crlf :crlf
           "1" :crlf "a" :crlf "0" :crlf :crlf)
      (bad "HTTP/1.1 200 OK" :crlf "Transfer-Encoding: chunked" :crlf :crlf "2" :crlf "abc" :crlf "0" :crlf :crlf)
      (bad "HTTP/1.1 200 OK" :crlf "Transfer-Encoding: chunked" :crlf :crlf "2;x=y" :crlf "ab" :crlf "0" :crlf :crlf)
      (bad "HTTP/1.1 200 OK" :crlf "Transfer-Encoding: chunked" :crlf :crlf "2" :crlf "ab" :crlf)
      (bad "HTTP/1.1 200 OK" :crlf "Transfer-Encoding: chunked" :crlf :crlf "2" :lf "ab" :crlf "0" :crlf :crlf)
      (bad "HTTP/1.1 200 OK" :crlf "Transfer-Encoding: chunked" :crlf :crlf "0" :crlf)
      ;; no framing, and the connection is not said to close
      (bad "HTTP/1.1 200 OK" :crlf "X: y" :crlf :crlf "abc"))))
